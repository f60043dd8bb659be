// The flash_attention family's replay kernels (replay.h): attention and attention_back
// over blocks of query rows (causal, sliding window, packed segments, grouped-query K/V).
// A block of up to kAttnRows queries of one head and its visible keys make a score block
// [rows, keys] in the thread's scratch (never [T, T]); its products are gemm.h's
// micro-kernel on packed panels (attn_gemm). The probabilities are made as the numpy
// kernel makes them, exp(s - max) / sum with s = scale (q . k), exp from vmath.h.
//
// Operands are read through strides, so heads-first ([B, H, T, hd]) and token-major
// ([B, T, H, hd]) are one kernel. Sinks (gpt-oss: a logit sinks[h] of value 0 in every row's
// softmax) join each row's max and sum as the numpy kernel adds them.

static const int64_t kAttnRows = 64;

// The dot product of two rows of d floats, in a fixed order (lanes, then the lanes' sum).
static inline float attn_dot(const float* a, const float* b, int64_t d) {
    int64_t j = 0;
    float s = 0.0f;
    if (d >= VL) {
        Vec acc = vzero();
        for (; j + VL <= d; j += VL) acc = vfma(vload(a + j), vload(b + j), acc);
        float lanes[VL];
        vstore(lanes, acc);
        for (int l = 0; l < VL; l++) s += lanes[l];
    }
    for (; j < d; j++) s += a[j] * b[j];
    return s;
}

// C[M, N] (+)= A[M, Kd] . B[Kd, N] on one thread, B(k, n) = b[k bk + n bn] packed a strip of
// NR columns at a time into ``panel`` (Kd x NR floats); each element of C one fused
// multiply-add chain over k (continuing C's value when ``accumulate``).
static void attn_gemm(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda,
                      const float* b, int64_t bk, int64_t bn, float* C, int64_t ldc,
                      bool accumulate, float* panel) {
    if (M == 0 || Kd == 0) return;
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        const int cols = (int)(N - n0 < NR ? N - n0 : NR);
        for (int64_t k = 0; k < Kd; k++) {
            float* dst = panel + k * NR;
            const float* src = b + k * bk + n0 * bn;
            for (int j = 0; j < cols; j++) dst[j] = src[j * bn];
            for (int j = cols; j < NR; j++) dst[j] = 0.0f;
        }
        rows_times_panel(M, Kd, A, lda, panel, NR, C + n0, ldc, !accumulate, cols);
    }
}

struct Attention {
    const float *q, *k, *v;
    const int32_t* seg;              // [B, T] segment ids, or null
    const float* sinks;              // [H] sink logits, or null
    int64_t B, H, KV, T, hd;
    int64_t qb, qh, qt, kb, kh, kt;  // strides of q (o, dO, dq) and of k (v, dk, dv)
    float scale;
    bool causal;
    int64_t window;

    int64_t q_at(int64_t b, int64_t h, int64_t t) const { return b * qb + h * qh + t * qt; }
    int64_t k_at(int64_t b, int64_t h, int64_t t) const { return b * kb + h * kh + t * kt; }
    // The keys a block of queries [t0, t1) may see between them: [j0, j1).
    void keys(int64_t t0, int64_t t1, int64_t& j0, int64_t& j1) const {
        j1 = causal ? t1 : T;
        j0 = window > 0 && t0 - window + 1 > 0 ? t0 - window + 1 : 0;
    }
    bool visible(int64_t b, int64_t t, int64_t j) const {
        if (causal && (j > t || (window > 0 && t - j >= window))) return false;
        return !seg || seg[b * T + t] == seg[b * T + j];
    }
    // P [t1 - t0, j1 - j0] of head h (rows L = j1 - j0 apart), each row's log-sum-exp and,
    // with sinks, each row's sink probability.
    void probabilities(int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t j0, int64_t j1,
                       float* P, float* lse, float* panel, float* psink = nullptr) const {
        const int64_t L = j1 - j0, kvh = h / (H / KV);
        attn_gemm(t1 - t0, L, hd, q + q_at(b, h, t0), qt, k + k_at(b, kvh, j0), 1, kt, P, L,
                  false, panel);
        for (int64_t t = t0; t < t1; t++) {
            float* p = P + (t - t0) * L;
            float top = -INFINITY;
            for (int64_t j = j0; j < j1; j++) {
                p[j - j0] = visible(b, t, j) ? p[j - j0] * scale : -INFINITY;
                top = p[j - j0] > top ? p[j - j0] : top;
            }
            if (sinks) top = sinks[h] > top ? sinks[h] : top;
            vf_apply(p, p, L, [top](vf s) { return vf_exp(s - top); });
            double sum = 0.0;   // in f64: a long row rounds once
            for (int64_t j = 0; j < L; j++) sum += (double)p[j];
            float den = (float)sum, sink = 0.0f;
            if (sinks) {
                float one[VW] = {sinks[h] - top};
                sink = vf_exp(vf_load(one))[0];
                den = den + sink;
            }
            vf_apply(p, p, L, [den](vf x) { return x / den; });
            if (psink) psink[t - t0] = sink / den;
            if (lse) lse[t - t0] = top + logf(den);
        }
    }
};

static Attention attention_of(const ReplayNode& n) {
    Attention a;
    a.q = (const float*)n.p[1];
    a.k = (const float*)n.p[2];
    a.v = (const float*)n.p[3];
    a.seg = (const int32_t*)n.p[4];
    a.sinks = (const float*)n.p[7];
    a.B = n.i[0]; a.H = n.i[1]; a.KV = n.i[2]; a.T = n.i[3]; a.hd = n.i[4];
    const bool token_major = n.i[5] != 0;
    a.causal = n.i[6] != 0;
    a.window = n.i[7];
    a.scale = (float)n.f[0];
    if (token_major) {
        a.qb = a.T * a.H * a.hd; a.qh = a.hd; a.qt = a.H * a.hd;
        a.kb = a.T * a.KV * a.hd; a.kh = a.hd; a.kt = a.KV * a.hd;
    } else {
        a.qb = a.H * a.T * a.hd; a.qh = a.T * a.hd; a.qt = a.hd;
        a.kb = a.KV * a.T * a.hd; a.kh = a.T * a.hd; a.kt = a.hd;
    }
    return a;
}

// o (q's layout) and, when asked, L [B, H, T] after it. A task is one block of rows of
// one head. p: out, q, k, v, segments or null, -, -, sinks or null; i: B, H, KV, T, hd,
// token_major, causal, window, save_lse; f: scale.
TG_REPLAY_KERNEL(attention) {
    const Attention a = attention_of(n);
    float* o = (float*)n.p[0];
    float* lse = n.i[8] ? o + a.B * a.H * a.T * a.hd : nullptr;
    const int64_t blocks = (a.T + kAttnRows - 1) / kAttnRows;
    const int64_t span = a.T + kAttnRows;   // keys a block may see, at most
    pool_for(a.B * a.H * blocks, [&](int64_t task, int) {
        const int64_t b = task / (a.H * blocks), h = task / blocks % a.H;
        const int64_t t0 = task % blocks * kAttnRows, t1 = t0 + kAttnRows < a.T ? t0 + kAttnRows : a.T;
        int64_t j0, j1;
        a.keys(t0, t1, j0, j1);
        const int64_t L = j1 - j0, big = L > a.hd ? L : a.hd;
        float* P = replay_scratch((size_t)(kAttnRows * span + big * NR + kAttnRows));
        float* panel = P + kAttnRows * span;
        float* l = panel + big * NR;
        a.probabilities(b, h, t0, t1, j0, j1, P, lse ? l : nullptr, panel);
        attn_gemm(t1 - t0, a.hd, L, P, L, a.v + a.k_at(b, h / (a.H / a.KV), j0), a.kt, 1,
                  o + a.q_at(b, h, t0), a.qt, false, panel);
        if (lse)
            for (int64_t t = t0; t < t1; t++) lse[(b * a.H + h) * a.T + t] = l[t - t0];
    });
    return 0;
}

// The backward of one block of query rows [t0, t1) of head h, first part: P again, dP = dO
// V^T, dS = (dP - rowsum(dO * O)) * P * scale into dS, its rows of dq = dS K, and each
// row's P_sink rowsum(dO * O) into sink_terms (with sinks). P, dS: [t1 - t0, L] for the
// block's keys [j0, j0 + L).
static void back_rows(const Attention& a, const float* o, const float* g, float* dq, int64_t b,
                      int64_t h, int64_t t0, int64_t t1, float* P, float* dS, float* panel,
                      float* psink, float* sink_terms) {
    int64_t j0, j1;
    a.keys(t0, t1, j0, j1);
    const int64_t L = j1 - j0, R = t1 - t0, kvh = h / (a.H / a.KV);
    a.probabilities(b, h, t0, t1, j0, j1, P, nullptr, panel, psink);
    const float* gb = g + a.q_at(b, h, t0);
    attn_gemm(R, L, a.hd, gb, a.qt, a.v + a.k_at(b, kvh, j0), 1, a.kt, dS, L, false, panel);
    for (int64_t r = 0; r < R; r++) {
        const float delta = attn_dot(gb + r * a.qt, o + a.q_at(b, h, t0 + r), a.hd);
        if (a.sinks) sink_terms[r] = psink[r] * delta;
        float* ds = dS + r * L;
        const float* p = P + r * L;
        for (int64_t j = 0; j < L; j++) ds[j] = (ds[j] - delta) * p[j] * a.scale;
    }
    attn_gemm(R, a.hd, L, dS, L, a.k + a.k_at(b, kvh, j0), a.kt, 1, dq + a.q_at(b, h, t0), a.qt,
              false, panel);
}

// Second part, for the block's keys [ja, jb) (within its [j0, j0 + L)): dk += dS^T q and
// dv += P^T dO on those rows. Each element of dk and dv is one multiply-add chain over the
// block's rows, continued from its value, whichever keys a call takes.
static void back_keys(const Attention& a, const float* g, float* dk, float* dv, int64_t b,
                      int64_t h, int64_t t0, int64_t R, int64_t j0, int64_t L, const float* P,
                      const float* dS, int64_t ja, int64_t jb, float* T_, float* panel) {
    const int64_t w = jb - ja, kvh = h / (a.H / a.KV);
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = ja; j < jb; j++) T_[(j - ja) * R + r] = dS[r * L + j - j0];
    attn_gemm(w, a.hd, R, T_, R, a.q + a.q_at(b, h, t0), a.qt, 1, dk + a.k_at(b, kvh, ja), a.kt,
              true, panel);
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = ja; j < jb; j++) T_[(j - ja) * R + r] = P[r * L + j - j0];
    attn_gemm(w, a.hd, R, T_, R, g + a.q_at(b, h, t0), a.qt, 1, dv + a.k_at(b, kvh, ja), a.kt,
              true, panel);
}

// The P and dS blocks of one head that the backward by phases keeps between its parts,
// kept by the calling thread and grown on demand (a fresh one each call would cost its
// page faults), at most kAttnKept floats: longer sequences take their blocks in groups.
static thread_local std::vector<float> t_attn_kept;
static KeptRegistration attn_kept([] { std::vector<float>().swap(t_attn_kept); });
static const int64_t kAttnKept = (int64_t)1 << 23;   // 32 MiB

// Whether the backward goes by phases: per head, every block of query rows at once, then
// every strip of keys at once, instead of a task per K/V head (which alone writes its dk
// and dv). Both make every value with the same operations in the same order, so either
// gives the same bits; the phases keep the threads busy where the K/V heads are fewer than
// the threads or do not divide among them (SmolLM2's 3 on 2 threads: one thread idle half
// the time; Gemma 3 270M's 1: one thread), at the cost of a meeting of the threads per
// part. Counted in blocks of rows, each scheme's longest thread.
static bool back_by_phases(const Attention& a, int64_t scheme) {
    if (scheme != 0) return scheme == 2;
    const int64_t threads = pool_threads(), blocks = (a.T + kAttnRows - 1) / kAttnRows;
    const int64_t per_head = (a.B * a.KV + threads - 1) / threads * (a.H / a.KV) * blocks;
    const int64_t phases = a.B * a.H * ((blocks + threads - 1) / threads);
    return phases < per_head;
}

// dq, dk, dv (and d sinks [H]) packed flat (each in its operand's layout). Per head h and
// block of query rows in order: back_rows, then back_keys over the block's keys, so each
// dk and dv element sums the blocks in (h, block) order; d sinks [h] is -sum over the rows,
// in order, of P_sink rowsum(dO * O), the batch rows' sums added in order. A task per K/V
// head of a batch row (with its group of query heads), or by phases (back_by_phases).
// p: out, q, k, v, segments or null, o, dO, sinks or null; i as attention's, then the scheme
// (0: back_by_phases decides, 1: per K/V head, 2: by phases); f: scale.
TG_REPLAY_KERNEL(attention_back) {
    const Attention a = attention_of(n);
    const float *o = (const float*)n.p[5], *g = (const float*)n.p[6];
    float* dq = (float*)n.p[0];
    float* dk = dq + a.B * a.H * a.T * a.hd;
    float* dv = dk + a.B * a.KV * a.T * a.hd;
    const int64_t G = a.H / a.KV, span = a.T + kAttnRows, blocks = (a.T + kAttnRows - 1) / kAttnRows;
    const int64_t big = (span > a.hd ? span : a.hd);
    std::vector<float> sink_terms(a.sinks ? (size_t)(a.B * a.H * a.T) : 0);   // [B, H, T]
    if (!back_by_phases(a, n.i[9])) {
        pool_for(a.B * a.KV, [&](int64_t task, int) {
            const int64_t b = task / a.KV, kvh = task % a.KV;
            float* P = replay_scratch((size_t)(3 * kAttnRows * span + big * NR + kAttnRows));
            float* dS = P + kAttnRows * span;
            float* T_ = dS + kAttnRows * span;   // P^T or dS^T, [keys][rows]
            float* panel = T_ + kAttnRows * span;
            float* psink = panel + big * NR;
            for (int64_t t = 0; t < a.T; t++)
                for (int64_t d = 0; d < a.hd; d++)
                    dk[a.k_at(b, kvh, t) + d] = dv[a.k_at(b, kvh, t) + d] = 0.0f;
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                for (int64_t t0 = 0; t0 < a.T; t0 += kAttnRows) {
                    const int64_t t1 = t0 + kAttnRows < a.T ? t0 + kAttnRows : a.T;
                    int64_t j0, j1;
                    a.keys(t0, t1, j0, j1);
                    back_rows(a, o, g, dq, b, h, t0, t1, P, dS, panel, psink,
                              a.sinks ? sink_terms.data() + (b * a.H + h) * a.T + t0 : nullptr);
                    back_keys(a, g, dk, dv, b, h, t0, t1 - t0, j0, j1 - j0, P, dS, j0, j1, T_, panel);
                }
        });
    } else {
        replay_for(a.B * a.KV * a.T, a.hd, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; i++) {
                const int64_t b = i / (a.KV * a.T), kvh = i / a.T % a.KV, t = i % a.T;
                for (int64_t d = 0; d < a.hd; d++) dk[a.k_at(b, kvh, t) + d] = dv[a.k_at(b, kvh, t) + d] = 0.0f;
            }
        });
        struct Block { int64_t t0, t1, j0, j1; float *P, *dS; };
        std::vector<Block> group;
        for (int64_t b = 0; b < a.B; b++)
            for (int64_t h = 0; h < a.H; h++)
                for (int64_t first = 0; first < blocks;) {
                    // the next blocks whose P and dS fit the kept memory (one at least)
                    group.clear();
                    int64_t kept = 0;
                    for (int64_t i = first; i < blocks; i++) {
                        Block blk;
                        blk.t0 = i * kAttnRows;
                        blk.t1 = blk.t0 + kAttnRows < a.T ? blk.t0 + kAttnRows : a.T;
                        a.keys(blk.t0, blk.t1, blk.j0, blk.j1);
                        const int64_t need = 2 * (blk.t1 - blk.t0) * (blk.j1 - blk.j0);
                        if (!group.empty() && kept + need > kAttnKept) break;
                        group.push_back(blk);
                        kept += need;
                    }
                    if ((int64_t)t_attn_kept.size() < kept) t_attn_kept.resize((size_t)kept);
                    float* at = t_attn_kept.data();
                    for (Block& blk : group) {
                        const int64_t size = (blk.t1 - blk.t0) * (blk.j1 - blk.j0);
                        blk.P = at;
                        blk.dS = at + size;
                        at += 2 * size;
                    }
                    pool_for((int64_t)group.size(), [&](int64_t i, int) {
                        const Block& blk = group[(size_t)i];
                        float* panel = replay_scratch((size_t)(big * NR + kAttnRows));
                        back_rows(a, o, g, dq, b, h, blk.t0, blk.t1, blk.P, blk.dS, panel,
                                  panel + big * NR,
                                  a.sinks ? sink_terms.data() + (b * a.H + h) * a.T + blk.t0 : nullptr);
                    });
                    int64_t lo = a.T, hi = 0;   // the keys the group's blocks see
                    for (const Block& blk : group) {
                        lo = blk.j0 < lo ? blk.j0 : lo;
                        hi = blk.j1 > hi ? blk.j1 : hi;
                    }
                    pool_for((hi - lo + kAttnRows - 1) / kAttnRows, [&](int64_t strip, int) {
                        const int64_t ja = lo + strip * kAttnRows, jb = ja + kAttnRows < hi ? ja + kAttnRows : hi;
                        float* T_ = replay_scratch((size_t)(kAttnRows * kAttnRows + big * NR));
                        float* panel = T_ + kAttnRows * kAttnRows;
                        for (const Block& blk : group) {   // in order: each chain as per head
                            const int64_t s0 = ja > blk.j0 ? ja : blk.j0, s1 = jb < blk.j1 ? jb : blk.j1;
                            if (s0 < s1)
                                back_keys(a, g, dk, dv, b, h, blk.t0, blk.t1 - blk.t0, blk.j0,
                                          blk.j1 - blk.j0, blk.P, blk.dS, s0, s1, T_, panel);
                        }
                    });
                    first += (int64_t)group.size();
                }
    }
    if (a.sinks) {
        float* dsinks = dv + a.B * a.KV * a.T * a.hd;
        for (int64_t h = 0; h < a.H; h++) {
            dsinks[h] = 0.0f;
            for (int64_t b = 0; b < a.B; b++) {
                float part = 0.0f;
                for (int64_t t = 0; t < a.T; t++) part -= sink_terms[(b * a.H + h) * a.T + t];
                dsinks[h] += part;
            }
        }
    }
    return 0;
}

// Generation's attention over a KV cache, four graph nodes computed by two kernels (the
// numpy backend's fusion of matmul(q, K^T) + mask, softmax(scale), matmul(P, V); see
// replay.py's @fuses): o = softmax(scale (q K^T + mask)) V for q [R, KV, G, hd] against the
// caches [R, KV, L, hd]. Only the rows the mask opens are read: a row whose additive mask
// is -1e29 or less (kvcache.py's MASKED, -1e30) has weight exactly 0 in numpy's softmax
// (exp of about -1e29 is 0), so leaving it out changes no value, and a token costs its
// filled rows, not the cache's length. The mask is [L] (one sequence) or [R, 1, 1, L].
//
// cache_scores runs where the scores' matmul would (q is ready there, and its buffer may be
// another's later) and leaves the probabilities of the open rows and their indices in the
// fusion's own memory ``mem``: [R * KV * G][L] probabilities, then per batch row r an
// int32 count and the open rows, L + 1 ints. cache_values runs where the last matmul would
// (V's row for the token is written there).

// p: mem, q, kc, mask; i: R, KV, G, L, hd, mask per row (0/1); f: scale.
TG_REPLAY_KERNEL(cache_scores) {
    float* probs = (float*)n.p[0];
    const float *q = (const float*)n.p[1], *kc = (const float*)n.p[2], *mask = (const float*)n.p[3];
    const int64_t R = n.i[0], KV = n.i[1], G = n.i[2], L = n.i[3], hd = n.i[4];
    const bool per_row = n.i[5] != 0;
    const float scale = (float)n.f[0];
    int32_t* open_rows = (int32_t*)(probs + R * KV * G * L);
    for (int64_t r = 0; r < R; r++) {
        const float* m = mask + (per_row ? r * L : 0);
        int32_t* rows = open_rows + r * (L + 1);
        int32_t open = 0;
        for (int64_t j = 0; j < L; j++)
            if (m[j] > -1e29f) rows[1 + open++] = (int32_t)j;
        if (open == 0)   // nothing open: numpy's softmax is uniform over every row
            for (int64_t j = 0; j < L; j++) rows[1 + open++] = (int32_t)j;
        rows[0] = open;
    }
    pool_for(R * KV * G, [&](int64_t task, int) {
        const int64_t r = task / (KV * G), kvh = task / G;
        const float* m = mask + (per_row ? r * L : 0);
        const int32_t* rows = open_rows + r * (L + 1);
        const int64_t open = rows[0];
        const float *qr = q + task * hd, *k = kc + kvh * L * hd;
        float* p = probs + task * L;
        float top = -INFINITY;
        for (int64_t i = 0; i < open; i++) {
            const int64_t j = rows[1 + i];
            p[i] = (attn_dot(qr, k + j * hd, hd) + m[j]) * scale;
            top = p[i] > top ? p[i] : top;
        }
        vf_apply(p, p, open, [top](vf s) { return vf_exp(s - top); });
        double sum = 0.0;
        for (int64_t i = 0; i < open; i++) sum += (double)p[i];
        const float den = (float)sum;
        vf_apply(p, p, open, [den](vf x) { return x / den; });
    });
    return 0;
}

// p: out, mem, vc; i: R, KV, G, L, hd.
TG_REPLAY_KERNEL(cache_values) {
    float* out = (float*)n.p[0];
    const float *probs = (const float*)n.p[1], *vc = (const float*)n.p[2];
    const int64_t R = n.i[0], KV = n.i[1], G = n.i[2], L = n.i[3], hd = n.i[4];
    const int32_t* open_rows = (const int32_t*)(probs + R * KV * G * L);
    pool_for(R * KV * G, [&](int64_t task, int) {
        const int64_t r = task / (KV * G), kvh = task / G;
        const int32_t* rows = open_rows + r * (L + 1);
        const float *p = probs + task * L, *v = vc + kvh * L * hd;
        float* o = out + task * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
        for (int64_t i = 0; i < rows[0]; i++) {
            const float* vr = v + (int64_t)rows[1 + i] * hd;
            for (int64_t d = 0; d < hd; d++) o[d] += p[i] * vr[d];
        }
    });
    return 0;
}
