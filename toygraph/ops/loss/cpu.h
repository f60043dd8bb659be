// The loss family's replay kernels (replay.h): cross_entropy, cross_entropy_back and
// count_valid over logits [N, V] and labels [N] (-1: ignored).

// The largest value of a row.
static inline float ce_max(const float* z, int64_t V) {
    float top = -INFINITY;
    for (int64_t j = 0; j < V; j++) top = z[j] > top ? z[j] : top;
    return top;
}

// The sum of exp(z - top) over a row, each exp also written to ``e`` when given: the
// vector lanes sum runs of 256 elements, each run's sum is added in f64, so a vocabulary
// of 262,144 rounds about as little as numpy's pairwise sum (one f32 chain would round
// V times).
static inline float ce_sum_exp(const float* z, int64_t V, float top, float* e) {
    double total = 0.0;
    for (int64_t j0 = 0; j0 < V; j0 += 256) {
        const int64_t j1 = j0 + 256 < V ? j0 + 256 : V;
        vf acc{};
        int64_t j = j0;
        for (; j + VW <= j1; j += VW) {
            const vf x = vf_exp(vf_load(z + j) - top);
            if (e) vf_store(e + j, x);
            acc += x;
        }
        float run = 0.0f;
        for (int l = 0; l < VW; l++) run += acc[l];
        for (; j < j1; j++) {
            float one[VW] = {0};
            one[0] = z[j] - top;
            const float x = vf_exp(vf_load(one))[0];
            if (e) e[j] = x;
            run += x;
        }
        total += (double)run;
    }
    return (float)total;
}

// The sum (or mean over the counted rows) of -log softmax(z)[label] over rows whose label
// is not ignored: each row's loss in f32, their sum in f64 in row order.
// p: out (one f32), logits, labels (i32); i: N, V, mean (0/1).
TG_REPLAY_KERNEL(cross_entropy) {
    float* out = (float*)n.p[0];
    const float* logits = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[2];
    const int64_t N = n.i[0], V = n.i[1];
    std::vector<float> loss((size_t)N, 0.0f);
    pool_for(N, [&](int64_t r, int) {
        if (labels[r] < 0) return;
        const float* z = logits + r * V;
        const float top = ce_max(z, V);
        loss[r] = logf(ce_sum_exp(z, V, top, nullptr)) - (z[labels[r]] - top);
    });
    double total = 0.0;
    int64_t counted = 0;
    for (int64_t r = 0; r < N; r++)
        if (labels[r] >= 0) {
            total += (double)loss[r];
            counted++;
        }
    *out = (float)(n.i[2] ? (counted ? total / (double)counted : 0.0) : total);
    return 0;
}

// (softmax(z) - onehot(label)) times g (over the counted rows for a mean), zero on ignored
// rows. p: out [N, V], logits, labels, g (one f32); i: N, V, mean.
TG_REPLAY_KERNEL(cross_entropy_back) {
    float* out = (float*)n.p[0];
    const float* logits = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[2];
    const float g = *(const float*)n.p[3];
    const int64_t N = n.i[0], V = n.i[1];
    int64_t counted = 0;
    for (int64_t r = 0; r < N; r++) counted += labels[r] >= 0;
    const float w = n.i[2] ? (counted ? g / (float)counted : 0.0f * g) : g;
    pool_for(N, [&](int64_t r, int) {
        const float* z = logits + r * V;
        float* o = out + r * V;
        const float sum = ce_sum_exp(z, V, ce_max(z, V), o);
        const bool valid = labels[r] >= 0;
        const float rw = valid ? w : 0.0f;
        vf_apply(o, o, V, [sum](vf x) { return x / sum; });
        if (valid) o[labels[r]] -= 1.0f;
        vf_apply(o, o, V, [rw](vf x) { return x * rw; });
    });
    return 0;
}

// The number of labels that are not ignored, as one f32. p: out, labels; i: N.
TG_REPLAY_KERNEL(count_valid) {
    const int32_t* labels = (const int32_t*)n.p[1];
    int64_t counted = 0;
    for (int64_t r = 0; r < n.i[0]; r++) counted += labels[r] >= 0;
    *(float*)n.p[0] = (float)counted;
    return 0;
}

// The fused head and loss (linear_cross_entropy): z = h W^T a chunk of the counted rows at
// a time (kLceRows, as the numpy kernel's LCE_ROWS), so only [chunk, V] logits exist; W is
// the head [V, D] in f32 or in its GGUF blocks (gemm_on_blocks: the products the numpy
// backend's block kernel makes, the same kernel choice for a chunk of a few rows).
static const int64_t kLceRows = 128;

struct Head {
    const float* f32;     // W [V, D] in f32, or null
    const u8* blocks;     // else its blocks: format fmt, rows row_bytes apart
    int fmt, few;         // few: the kernel for a chunk of a few rows (0 auto, 2 f32 dots)
    int64_t row_bytes, V, D;

    // z [c, V] = hc [c, D] . W^T
    int logits(const float* hc, int64_t c, float* z) const {
        if (f32) {
            gemm_f32(c, V, D, Strided{hc, D, 1, 1.0f}, Strided{f32, 1, D, 1.0f}, z, V);
            return 0;
        }
        return gemm_on_blocks(fmt, blocks, row_bytes, V, D, hc, D, c, z, V, 1,
                              c <= DOT_MAX_M ? few : 0);
    }
    // dh [c, D] = dz [c, V] . W
    int input_grad(const float* dz, int64_t c, float* dh) const {
        if (f32) {
            gemm_f32(c, D, V, Strided{dz, V, 1, 1.0f}, Strided{f32, D, 1, 1.0f}, dh, D);
            return 0;
        }
        return gemm_on_blocks(fmt, blocks, row_bytes, V, D, dz, V, c, dh, D, 0, 1);
    }
};

static Head head_of(const ReplayNode& n, const void* w) {
    Head h;
    h.fmt = (int)n.i[2];
    h.f32 = h.fmt < 0 ? (const float*)w : nullptr;
    h.blocks = h.fmt < 0 ? nullptr : (const u8*)w;
    h.row_bytes = n.i[3];
    h.V = n.i[1];
    h.D = n.i[4];
    h.few = (int)n.i[5];
    return h;
}

// The counted rows (label >= 0), in order.
static std::vector<int64_t> lce_rows(const int32_t* labels, int64_t N) {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < N; r++)
        if (labels[r] >= 0) rows.push_back(r);
    return rows;
}

// Chunk [start, start + c) of the counted rows of h gathered into hc, and z = hc W^T.
static int lce_logits(const Head& w, const float* h, const std::vector<int64_t>& rows,
                      int64_t start, int64_t c, float* hc, float* z) {
    for (int64_t i = 0; i < c; i++) memcpy(hc + i * w.D, h + rows[start + i] * w.D, (size_t)w.D * 4);
    return w.logits(hc, c, z);
}

// A chunk of logits [chunk, V] lives in a buffer kept by the calling thread, grown on
// demand: a fresh one each call costs the page faults of tens of megabytes a step
// (Qwen2.5-Coder-0.5B's step, 128 rows, the head fused: 794 ms with a fresh one a call,
// 704-757 ms kept; bench_lora.py, 2 threads).
static thread_local std::vector<float> t_lce_logits;
static KeptRegistration lce_kept([] { std::vector<float>().swap(t_lce_logits); });

static float* lce_buffer(int64_t floats) {
    if ((int64_t)t_lce_logits.size() < floats) t_lce_logits.resize((size_t)floats);
    return t_lce_logits.data();
}

// What the fused head's forward hands its backward when replay.py pairs them (the loss
// family's cpu.py; numpy_backend's ``_handoffs``): the first chunk's softmax(z) - onehot in
// the buffer (the forward computes its chunks last to first, the backward first to last),
// which the backward would recompute from the same h, W and labels with the same kernels,
// so reading it changes no bit and saves a product over the whole vocabulary. The backend
// pairs a forward with its backward only where no other node of either op runs between
// them (nothing else writes the buffer meanwhile); the backward clears ``dz``.
struct LceHandoff {
    float* dz;
    int64_t start, c, V;
};

// The chunk ``cell`` holds if it is [start, start + c) of V columns, else null; either way
// the cell is left empty.
static const float* lce_take(LceHandoff* cell, int64_t start, int64_t c, int64_t V) {
    if (!cell || !cell->dz) return nullptr;
    float* dz = cell->dz;
    cell->dz = nullptr;
    return cell->start == start && cell->c == c && cell->V == V ? dz : nullptr;
}

// The per-row losses log(sum) + max - z[label] (0 on ignored rows) for "none", else their
// sum (f64, row order) or mean. The chunks run last to first, so that with an LceHandoff
// cell (else null) the first chunk's softmax(z) - onehot is what the buffer holds at the
// end. p: out, h [N, D], W, labels, the cell; i: N, V, fmt (-1: f32), row_bytes, D, few,
// reduction (0 none, 1 sum, 2 mean).
TG_REPLAY_KERNEL(linear_cross_entropy) {
    float* out = (float*)n.p[0];
    const float* h = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[3];
    LceHandoff* cell = (LceHandoff*)n.p[4];
    const Head w = head_of(n, n.p[2]);
    const int64_t N = n.i[0], reduction = n.i[6];
    if (cell) cell->dz = nullptr;
    const std::vector<int64_t> rows = lce_rows(labels, N);
    const int64_t counted = (int64_t)rows.size();
    const int64_t chunk = counted < kLceRows ? counted : kLceRows;
    std::vector<float> hc((size_t)(chunk * w.D)), top(chunk), sum(chunk), picked(chunk);
    std::vector<float> losses((size_t)counted);
    float* z = lce_buffer(chunk * w.V);
    for (int64_t start = (counted - 1) / kLceRows * kLceRows; start >= 0 && counted; start -= kLceRows) {
        const int64_t c = counted - start < kLceRows ? counted - start : kLceRows;
        const bool hand = cell && start == 0;
        const int rc = lce_logits(w, h, rows, start, c, hc.data(), z);
        if (rc != 0) return rc;
        pool_for(c, [&](int64_t i, int) {
            float* zr = z + i * w.V;
            const int32_t label = labels[rows[start + i]];
            picked[i] = zr[label];
            top[i] = ce_max(zr, w.V);
            sum[i] = ce_sum_exp(zr, w.V, top[i], hand ? zr : nullptr);
            if (!hand) return;
            const float s = sum[i];   // the backward's first steps, in its order
            vf_apply(zr, zr, w.V, [s](vf x) { return x / s; });
            zr[label] -= 1.0f;
        });
        for (int64_t i = 0; i < c; i++) losses[start + i] = logf(sum[i]) + top[i] - picked[i];
        if (hand) *cell = LceHandoff{z, start, c, w.V};
    }
    if (reduction == 0)
        for (int64_t r = 0; r < N; r++) out[r] = 0.0f;
    double total = 0.0;
    for (int64_t i = 0; i < counted; i++) {
        if (reduction == 0) out[rows[i]] = losses[i];
        total += (double)losses[i];
    }
    if (reduction == 1) *out = (float)total;
    if (reduction == 2) *out = (float)(rows.empty() ? 0.0 : total / (double)rows.size());
    return 0;
}

// dh (when asked) then dw (when asked) packed flat: dz = (softmax(z) - onehot) times g
// (per row for "none", / counted rows for a mean), dh rows = dz W, dw += dz^T h chunk by
// chunk in row order; the first chunk's softmax(z) - onehot taken from the forward where
// it handed it over. p: out, h, W, labels, g, the LceHandoff cell or null; i: N, V, fmt,
// row_bytes, D, few, reduction, grad_h, grad_w.
TG_REPLAY_KERNEL(linear_cross_entropy_back) {
    float* out = (float*)n.p[0];
    const float *h = (const float*)n.p[1], *g = (const float*)n.p[4];
    const int32_t* labels = (const int32_t*)n.p[3];
    const Head w = head_of(n, n.p[2]);
    const int64_t N = n.i[0], reduction = n.i[6];
    const bool grad_h = n.i[7] != 0, grad_w = n.i[8] != 0;
    float* dh = grad_h ? out : nullptr;
    float* dw = grad_w ? out + (grad_h ? N * w.D : 0) : nullptr;
    const std::vector<int64_t> rows = lce_rows(labels, N);
    const int64_t counted = (int64_t)rows.size();
    const int64_t chunk = counted < kLceRows ? counted : kLceRows;
    float* handed = (float*)lce_take((LceHandoff*)n.p[5], 0, chunk, w.V);
    if (grad_w && !w.f32) return -1;   // a head in blocks is frozen
    const int64_t size = (grad_h ? N * w.D : 0) + (grad_w ? w.V * w.D : 0);
    replay_for(size, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) out[i] = 0.0f;
    });
    const float scale = reduction == 2 ? (rows.empty() ? 0.0f * g[0] : g[0] / (float)counted) : g[0];
    std::vector<float> hc((size_t)(chunk * w.D));
    std::vector<float> dhc(grad_h ? (size_t)(chunk * w.D) : 0), tmp(grad_w ? (size_t)(w.V * w.D) : 0);
    for (int64_t start = 0; start < counted; start += kLceRows) {
        const int64_t c = counted - start < kLceRows ? counted - start : kLceRows;
        const bool given = handed && start == 0;   // later chunks reuse its buffer
        float* zc = given ? handed : lce_buffer(chunk * w.V);
        if (given) {
            for (int64_t i = 0; i < c; i++)
                memcpy(hc.data() + i * w.D, h + rows[start + i] * w.D, (size_t)w.D * 4);
        } else {
            const int rc = lce_logits(w, h, rows, start, c, hc.data(), zc);
            if (rc != 0) return rc;
        }
        pool_for(c, [&](int64_t i, int) {   // z = (exp(z - max) / sum - onehot) k
            float* zr = zc + i * w.V;
            const int64_t r = rows[start + i];
            const float k = reduction == 0 ? g[r] : scale;
            if (!given) {
                const float s = ce_sum_exp(zr, w.V, ce_max(zr, w.V), zr);
                vf_apply(zr, zr, w.V, [s](vf x) { return x / s; });
                zr[labels[r]] -= 1.0f;
            }
            vf_apply(zr, zr, w.V, [k](vf x) { return x * k; });
        });
        if (grad_h) {
            const int rc2 = w.input_grad(zc, c, dhc.data());
            if (rc2 != 0) return rc2;
            for (int64_t i = 0; i < c; i++)
                memcpy(dh + rows[start + i] * w.D, dhc.data() + i * w.D, (size_t)w.D * 4);
        }
        if (grad_w) {
            gemm_f32(w.V, w.D, c, Strided{zc, 1, w.V, 1.0f}, Strided{hc.data(), w.D, 1, 1.0f},
                     tmp.data(), w.D);
            replay_for(w.V * w.D, 1, [&](int64_t i0, int64_t i1) {
                for (int64_t i = i0; i < i1; i++) dw[i] += tmp[i];
            });
        }
    }
    return 0;
}
