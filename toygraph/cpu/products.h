// The engine's two products, which the replay kernels of several op families share
// (ops/gemm, loss, experts): on a weight kept in its GGUF blocks (gemm.h, dot.h, dot8.h,
// the kernel chosen by shape) and in f32 (gemm.h's micro-kernel on packed panels, threaded
// over strips and runs of rows). Assembled after replay.h, before the families' cpu.h.

// c = a . W^T (transposed: c [M, N], a [M, K]) or c = a . W (c [M, K], a [M, N]), W [N, K]
// in format ``fmt``, rows row_bytes apart. ``kernel``: 0 picks by shape (a few rows: the
// 8-bit dot kernels where built for the format, else the f32 ones), 1 the panel GEMM, 2
// the f32 row-dot kernels, 3 the 8-bit ones (transposed only). Returns 0, -1 (bad
// arguments) or -2 (no 8-bit kernel for this format, shape or CPU). ``add`` (else null):
// c = add + alpha c after the product (matmul_add; add's rows ldc apart), by the panel
// products tile by tile. engine.cpp's tg_matmul and the families' replay kernels call
// this function.
static int gemm_on_blocks(int fmt, const u8* w, int64_t row_bytes, int64_t N, int64_t K,
                          const float* a, int64_t lda, int64_t M, float* c, int64_t ldc,
                          int transposed, int kernel, const float* add = nullptr,
                          float alpha = 1.0f) {
    if (fmt < 0 || fmt >= kNumFormats || M < 0 || N < 0 || K < 0) return -1;
    Product p{&kFormats[fmt], w, row_bytes, N, K, a, lda, M, c, ldc, 0, 1};
    if (M == 0 || N == 0) return 0;
    bool tiled = true;   // whether the product applied the epilogue itself
    if (!transposed) {
        if (kernel >= 2) return -1;
        p.add = add, p.alpha = alpha;
        matmul_nn(p);
    } else if (kernel == 3) {
        if (!matmul_dot_q8(p)) return -2;
        tiled = false;
    } else if (kernel == 0 && M <= DOT_MAX_M) {
        if (!matmul_dot_q8(p)) matmul_dot(p);
        tiled = false;
    } else if (kernel == 2) {
        matmul_dot(p);
        tiled = false;
    } else {
        p.add = add, p.alpha = alpha;
        matmul_nt(p);
    }
    if (add && !tiled) {
        const int64_t width = transposed ? N : K;
        replay_for(M, width, [&](int64_t m0, int64_t m1) {
            gemm_epilogue(c, ldc, add, ldc, alpha, m0, m1, 0, width);
        });
    }
    return 0;
}

// Several products of one x of a few rows (generation's q, k and v; gate and up): c_i [M,
// N_i] = x . W_i^T for each of ``n`` weights (each its own format and rows; every Product's
// a, lda, M and K the same), as one job of the pool over all their rows. x is quantized once
// for the 8-bit kernels (its quantization depends on x alone), and the threads meet once
// instead of once a weight (generation on 2 threads: 1-2% more tokens/s, bench/results/
// shared-x-generation-*). Each product's rows go to the kernel gemm_on_blocks would give it
// (``kernel`` as there: 0 by shape, 2 the f32 dot kernels, 3 the 8-bit ones) in the same
// tasks, so every output is the separate product's, bit for bit. Returns as
// gemm_on_blocks (-2: an 8-bit kernel asked for where one product has none).
static int gemm_rows_shared_x(Product* ps, int n, int kernel) {
    if (n < 1 || n > 4) return -1;
    const int64_t M = ps[0].M, K = ps[0].K;
    if (M < 1 || M > DOT_MAX_M || K % 32 != 0 || (kernel != 0 && kernel != 2 && kernel != 3))
        return -1;
    for (int i = 1; i < n; i++)
        if (ps[i].M != M || ps[i].K != K || ps[i].a != ps[0].a || ps[i].lda != ps[0].lda) return -1;
#if defined(TG_DOT_Q8)
    typedef DotRowsQ8Fn Q8Fn;
#else
    typedef void (*Q8Fn)();   // no 8-bit kernels in this build: never set
#endif
    struct Part { const Product* p; Q8Fn q8; DotRowsFn f32; int64_t per, first_task; };
    Part parts[4];
    int64_t tasks = 0;
    bool any_q8 = false, any_f32 = false;
    for (int i = 0; i < n; i++) {
        const Product& p = ps[i];
        const int fmt = (int)(p.f - kFormats);
        Part& part = parts[i];
        part.p = &p;
        part.q8 = nullptr;
        part.f32 = nullptr;
#if defined(TG_DOT_Q8)
        if (kernel != 2 && K % p.f->qk == 0) part.q8 = kDotRowsQ8[fmt][M - 1];
#endif
        if (kernel == 3 && !part.q8) return -2;
        if (!part.q8) part.f32 = kDotRows[fmt][M - 1];   // null: dot_rows_decoded
        any_q8 |= part.q8 != nullptr;
        any_f32 |= !part.q8;
        part.per = dot_rows_per_task(p.N);
        part.first_task = tasks;
        tasks += (p.N + part.per - 1) / part.per;
    }
    const int64_t groups = K / 32;
#if defined(TG_DOT_Q8)
    std::vector<int8_t> q;
    std::vector<float> sums;
    XQ xq{};
    if (any_q8) xq = quantize_x(ps[0], q, sums);   // once for every weight
#endif
    std::vector<float> xs;   // matmul_dot's sums of x, once
    if (any_f32) x_sums(ps[0], xs);
    pool_for(tasks, [&](int64_t task, int) {
        int i = n - 1;
        while (task < parts[i].first_task) i--;
        const Part& part = parts[i];
        const int64_t n0 = (task - part.first_task) * part.per;
        const int64_t n1 = n0 + part.per < part.p->N ? n0 + part.per : part.p->N;
#if defined(TG_DOT_Q8)
        if (part.q8) { part.q8(*part.p, xq, n0, n1); return; }
#endif
        if (part.f32) part.f32(*part.p, xs.data(), groups, n0, n1);
        else dot_rows_decoded(*part.p, n0, n1);
    });
    return 0;
}

// An operand of the f32 product read through strides: element (i, j) is
// scale * p[i * s0 + j * s1], rounded as numpy's a * s.
struct Strided {
    const float* p;
    int64_t s0, s1;
    float scale;
    float at(int64_t i, int64_t j) const {
        const float v = p[i * s0 + j * s1];
        return scale != 1.0f ? v * scale : v;
    }
};

// c [M, N] (unit column stride, rows ldc apart) = A [M, K] . B [K, N]. A task is a run of
// rows and one or more strips of NR columns; it packs a strip of B as a [K][NR] panel. k is
// summed in runs of kGemmRun: each run one fused multiply-add chain (gemm.h's micro-kernel),
// the runs' sums added in order, so a long K (the head's 49152 rows in the backward)
// rounds like BLAS's blocked sums, not like one chain of 49152, and no task split changes a
// bit. A is read in place when its rows are unit-stride and unscaled, else packed once.
static const int64_t kGemmRun = 256;
// A task's least work in multiply-adds where several strips can share one: with a few rows
// of A (generation's LoRA products: 1-4 rows, K = 16 for s u B^T) a strip is a few hundred,
// less than the two threads' meeting at the pool's counter for it (8,960 columns, 280
// one-strip tasks: 45-90 us a product, against 12 us at 9 tasks).
static const int64_t kGemmTaskWork = 16384;

// Strip n0 (cols columns) of B, k in [k0, k0 + kk), as a [kk][NR] panel (zeros past cols).
static void pack_strip(const Strided& B, int64_t n0, int cols, int64_t k0, int64_t kk, float* panel) {
    if (B.s0 == 1 && B.scale == 1.0f) {
        // B transposed (x^T, g^T: LoRA's narrow products): the strip's columns are rows of
        // memory, moved by 8 x 8 transposes (a strided scalar copy cost as much as the
        // product of a rank-16 strip)
        rows_to_panel(B.p + n0 * B.s1 + k0, B.s1, cols, kk, panel);
    } else if (B.s1 == 1 && B.scale == 1.0f) {
        // B as it lies (the weight gradients' g, x): each k's strip is a run of memory
        for (int64_t k = 0; k < kk; k++) {
            float* dst = panel + k * NR;
            std::memcpy(dst, B.p + (k0 + k) * B.s0 + n0, (size_t)cols * 4);
            for (int j = cols; j < NR; j++) dst[j] = 0.0f;
        }
    } else {
        for (int64_t k = 0; k < kk; k++) {
            float* dst = panel + k * NR;
            for (int j = 0; j < cols; j++) dst[j] = B.at(k0 + k, n0 + j);
            for (int j = cols; j < NR; j++) dst[j] = 0.0f;
        }
    }
}

// Rows [m0, m1) of strip n0 of c: the runs of k in order, the first written, each later
// one's sum added (``part``: [rows][NR] of scratch).
static void gemm_strip(int64_t m0, int64_t m1, int64_t n0, int64_t N, int64_t K, const float* a,
                       int64_t lda, const Strided& B, float* c, int64_t ldc, float* panel, float* part) {
    const int cols = (int)(N - n0 < NR ? N - n0 : NR);
    pack_strip(B, n0, cols, 0, K, panel);
    float* tile = c + m0 * ldc + n0;
    if (K == 0)
        for (int64_t m = 0; m < m1 - m0; m++)
            for (int j = 0; j < cols; j++) tile[m * ldc + j] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += kGemmRun) {
        const int64_t kk = K - k0 < kGemmRun ? K - k0 : kGemmRun;
        if (k0 == 0) {
            rows_times_panel(m1 - m0, kk, a + m0 * lda, lda, panel, NR, tile, ldc, true, cols);
            continue;
        }
        rows_times_panel(m1 - m0, kk, a + m0 * lda + k0, lda, panel + k0 * NR, NR, part, NR,
                         true, NR);
        for (int64_t m = 0; m < m1 - m0; m++)
            for (int j = 0; j < cols; j++) tile[m * ldc + j] += part[m * NR + j];
    }
}

// Fewer strips than threads and every row in one run (a few rows times a narrow B:
// generation's x A^T, K up to the MLP's width): the runs of k are shared among the tasks
// instead, each run's sum kept apart ([M][NR] per run and strip) and then added in k order
// as gemm_strip adds them: the same bits, on every thread instead of one.
static void gemm_f32_k_runs(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                            const Strided& B, float* c, int64_t ldc) {
    const int64_t strips = (N + NR - 1) / NR, k_runs = (K + kGemmRun - 1) / kGemmRun;
    std::vector<float> sums((size_t)(strips * k_runs * M * NR));
    pool_for(strips * k_runs, [&](int64_t task, int) {
        const int64_t strip = task / k_runs, k0 = (task % k_runs) * kGemmRun;
        const int64_t kk = K - k0 < kGemmRun ? K - k0 : kGemmRun;
        const int cols = (int)(N - strip * NR < NR ? N - strip * NR : NR);
        float* panel = replay_scratch((size_t)(kGemmRun * NR));
        pack_strip(B, strip * NR, cols, k0, kk, panel);
        rows_times_panel(M, kk, a + k0, lda, panel, NR, sums.data() + task * M * NR, NR, true, NR);
    });
    for (int64_t strip = 0; strip < strips; strip++) {
        const int64_t n0 = strip * NR;
        const int cols = (int)(N - n0 < NR ? N - n0 : NR);
        for (int64_t r = 0; r < k_runs; r++) {
            const float* run = sums.data() + (strip * k_runs + r) * M * NR;
            for (int64_t m = 0; m < M; m++)
                for (int j = 0; j < cols; j++) {
                    float& out = c[m * ldc + n0 + j];
                    out = r == 0 ? run[m * NR + j] : out + run[m * NR + j];
                }
        }
    }
}

static void gemm_f32(int64_t M, int64_t N, int64_t K, Strided A, Strided B, float* c, int64_t ldc) {
    std::vector<float> packed;
    const float* a = A.p;
    if (A.s1 != 1 || A.scale != 1.0f) {
        packed.resize((size_t)(M * K));
        replay_for(M, K, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; m++)
                for (int64_t k = 0; k < K; k++) packed[m * K + k] = A.at(m, k);
        });
        a = packed.data();
        A.s0 = K;
    }
    const int64_t lda = A.s0, strips = (N + NR - 1) / NR, threads = pool_threads();
    // Runs of rows (whole micro-kernel tiles) so that there are a few tasks per thread.
    const int64_t want = 4 * threads;
    int64_t rows = (M * strips + want - 1) / want;
    rows = (rows + MR - 1) / MR * MR;
    if (rows < MR) rows = MR;
    const int64_t runs = (M + rows - 1) / rows;
    if (runs == 1 && strips < threads && K > kGemmRun) {
        gemm_f32_k_runs(M, N, K, a, lda, B, c, ldc);
        return;
    }
    // strips a task takes: enough work to outweigh a task's cost, and a task per thread
    const int64_t work = (M < rows ? M : rows) * NR * (K > 0 ? K : 1);
    int64_t group = kGemmTaskWork / work;
    if (group > strips / threads) group = strips / threads;
    if (group < 1) group = 1;
    const int64_t groups = (strips + group - 1) / group;
    pool_for(groups * runs, [&](int64_t task, int) {
        const int64_t s0 = (task % groups) * group, m0 = (task / groups) * rows;
        const int64_t s1 = s0 + group < strips ? s0 + group : strips;
        const int64_t m1 = m0 + rows < M ? m0 + rows : M;
        float* panel = replay_scratch((size_t)(K * NR + rows * NR));
        for (int64_t strip = s0; strip < s1; strip++)
            gemm_strip(m0, m1, strip * NR, N, K, a, lda, B, c, ldc, panel, panel + K * NR);
    });
}

