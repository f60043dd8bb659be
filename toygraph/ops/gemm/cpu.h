// The gemm family's replay kernels (replay.h): matmul and matmul_add, with the weight kept
// in its GGUF blocks (the engine's products of gemm.h, dot.h and dot8.h) or in f32.

// c = a . W^T (transposed: c [M, N], a [M, K]) or c = a . W (c [M, K], a [M, N]), W [N, K]
// in format ``fmt``, rows row_bytes apart. ``kernel``: 0 picks by shape (a few rows: the
// 8-bit dot kernels where built for the format, else the f32 ones), 1 the panel GEMM, 2
// the f32 row-dot kernels, 3 the 8-bit ones (transposed only). Returns 0, -1 (bad
// arguments) or -2 (no 8-bit kernel for this format, shape or CPU). engine.cpp's
// tg_matmul is this function.
static int gemm_on_blocks(int fmt, const u8* w, int64_t row_bytes, int64_t N, int64_t K,
                          const float* a, int64_t lda, int64_t M, float* c, int64_t ldc,
                          int transposed, int kernel) {
    if (fmt < 0 || fmt >= kNumFormats || M < 0 || N < 0 || K < 0) return -1;
    Product p{&kFormats[fmt], w, row_bytes, N, K, a, lda, M, c, ldc, 0, 1};
    if (M == 0 || N == 0) return 0;
    if (!transposed) {
        if (kernel >= 2) return -1;
        matmul_nn(p);
    } else if (kernel == 3) {
        if (!matmul_dot_q8(p)) return -2;
    } else if (kernel == 0 && M <= DOT_MAX_M) {
        if (!matmul_dot_q8(p)) matmul_dot(p);
    } else if (kernel == 2) {
        matmul_dot(p);
    } else {
        matmul_nt(p);
    }
    return 0;
}

// c = add + alpha c over a tile of c (rows m0..m1, columns n0..n1), rounded as numpy's
// matmul_add rounds it: the product scaled, then added (never one fma).
static inline void gemm_epilogue(float* c, int64_t ldc, const float* add, int64_t ld_add,
                                 float alpha, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; m++)
        for (int64_t j = n0; j < n1; j++) {
            float v = c[m * ldc + j];
            if (alpha != 1.0f) v = v * alpha;
            c[m * ldc + j] = add[m * ld_add + j] + v;
        }
}

// matmul(_add) with the weight in blocks: c [M, out] = a . W^T or a . W, then the
// epilogue when ``add`` is given. p: c, a, W's bytes, add or null; i: fmt, row_bytes,
// N, K, M, transposed, kernel; f: alpha.
TG_REPLAY_KERNEL(matmul_blocks) {
    float* c = (float*)n.p[0];
    const int64_t N = n.i[2], K = n.i[3], M = n.i[4];
    const int transposed = (int)n.i[5];
    const int64_t width_a = transposed ? K : N, width_c = transposed ? N : K;
    const int rc = gemm_on_blocks((int)n.i[0], (const u8*)n.p[2], n.i[1], N, K,
                                  (const float*)n.p[1], width_a, M, c, width_c, transposed,
                                  (int)n.i[6]);
    if (rc != 0 || !n.p[3]) return rc;
    const float* add = (const float*)n.p[3];
    const float alpha = (float)n.f[0];
    replay_for(M, width_c, [&](int64_t m0, int64_t m1) {
        gemm_epilogue(c, width_c, add, width_c, alpha, m0, m1, 0, width_c);
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

// c [M, N] (unit column stride, rows ldc apart) = A [M, K] . B [K, N]. A task is a strip of
// NR columns and a run of rows; it packs its strip of B as a [K][NR] panel. k is summed in
// runs of kGemmRun: each run one fused multiply-add chain (gemm.h's micro-kernel), the
// runs' sums added in order, so a long K (the head's 49152 rows in the backward) rounds
// like BLAS's blocked sums, not like one chain of 49152, and no task split changes a bit.
// A is read in place when its rows are unit-stride and unscaled, else packed once.
static const int64_t kGemmRun = 256;

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
    const int64_t lda = A.s0, strips = (N + NR - 1) / NR;
    // Runs of rows (whole micro-kernel tiles) so that there are a few tasks per thread.
    const int64_t want = 4 * (int64_t)pool_threads();
    int64_t rows = (M * strips + want - 1) / want;
    rows = (rows + MR - 1) / MR * MR;
    if (rows < MR) rows = MR;
    const int64_t runs = (M + rows - 1) / rows;
    pool_for(strips * runs, [&](int64_t task, int) {
        const int64_t n0 = (task % strips) * NR, m0 = (task / strips) * rows;
        const int64_t m1 = m0 + rows < M ? m0 + rows : M;
        const int cols = (int)(N - n0 < NR ? N - n0 : NR);
        float* panel = replay_scratch((size_t)(K * NR + rows * NR));
        float* part = panel + K * NR;   // one run of k's sums, [rows][NR]
        for (int64_t k = 0; k < K; k++) {
            float* dst = panel + k * NR;
            for (int j = 0; j < cols; j++) dst[j] = B.at(k, n0 + j);
            for (int j = cols; j < NR; j++) dst[j] = 0.0f;
        }
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
    });
}

// c [M, N] = (s op(a)) [M, K] . op(b) [K, N] in f32 (op: transposed or not). A narrow
// product (N below a strip, the LoRA rank: x A^T, x^T g) is computed as
// c^T = op(b)^T (s op(a))^T, so its strips are full, and transposed into c.
static void matmul_f32_one(float* c, const float* a, const float* b, int64_t M, int64_t K,
                           int64_t N, bool ta, bool tb, float s) {
    const Strided A{a, ta ? 1 : K, ta ? M : 1, s}, B{b, tb ? 1 : N, tb ? K : 1, 1.0f};
    if (N < NR && M > N) {
        std::vector<float> ct((size_t)(N * M));
        gemm_f32(N, M, K, Strided{B.p, B.s1, B.s0, 1.0f}, Strided{A.p, A.s1, A.s0, s}, ct.data(), M);
        replay_for(M, N, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; m++)
                for (int64_t j = 0; j < N; j++) c[m * N + j] = ct[j * M + m];
        });
    } else {
        gemm_f32(M, N, K, A, B, c, N);
    }
}

// matmul(_add) in f32 over ``batch`` products (batched operands of one shape: each a's,
// b's and c's matrix a whole number of them apart), then the epilogue when ``add`` is
// given. p: c, a, b, add or null; i: M, K, N, trans_a, trans_b, batch; f: s, alpha.
TG_REPLAY_KERNEL(matmul_f32) {
    float* c = (float*)n.p[0];
    const float *a = (const float*)n.p[1], *b = (const float*)n.p[2], *add = (const float*)n.p[3];
    const int64_t M = n.i[0], K = n.i[1], N = n.i[2], batch = n.i[5] > 0 ? n.i[5] : 1;
    const float alpha = (float)n.f[1];
    if (M == 0 || N == 0) return 0;
    for (int64_t i = 0; i < batch; i++)
        matmul_f32_one(c + i * M * N, a + i * M * K, b + i * K * N, M, K, N, n.i[3] != 0,
                       n.i[4] != 0, (float)n.f[0]);
    if (add)
        replay_for(batch * M, N, [&](int64_t m0, int64_t m1) {
            gemm_epilogue(c, N, add, N, alpha, m0, m1, 0, N);
        });
    return 0;
}
