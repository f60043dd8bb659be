// The gemm family's replay kernels (replay.h): matmul and matmul_add, with the weight kept
// in its GGUF blocks or in f32 (the engine's two products, cpu/products.h).

// matmul(_add) with the weight in blocks: c [M, out] = a . W^T or a . W, then the
// epilogue when ``add`` is given (gemm_on_blocks applies it). p: c, a, W's bytes, add or null; i: fmt, row_bytes,
// N, K, M, transposed, kernel; f: alpha.
TG_REPLAY_KERNEL(matmul_blocks) {
    float* c = (float*)n.p[0];
    const int64_t N = n.i[2], K = n.i[3], M = n.i[4];
    const int transposed = (int)n.i[5];
    const int64_t width_a = transposed ? K : N, width_c = transposed ? N : K;
    return gemm_on_blocks((int)n.i[0], (const u8*)n.p[2], n.i[1], N, K, (const float*)n.p[1],
                          width_a, M, c, width_c, transposed, (int)n.i[6],
                          (const float*)n.p[3], (float)n.f[0]);
}

// Products of one x [M, K] of a few rows with up to 4 weights in blocks (generation's q, k,
// v; gate, up): c_i [M, N_i] = x . W_i^T as one job (gemm_rows_shared_x). p: x, then c_i
// and W_i's bytes for each; i: count, K, M, kernel, then fmt, row_bytes, N for each.
TG_REPLAY_KERNEL(matmul_blocks_shared_x) {
    const int count = (int)n.i[0];
    const int64_t K = n.i[1], M = n.i[2];
    if (count < 1 || count > 4) return -1;
    Product ps[4];
    for (int j = 0; j < count; j++) {
        const int fmt = (int)n.i[4 + 3 * j];
        if (fmt < 0 || fmt >= kNumFormats) return -1;
        const int64_t N = n.i[6 + 3 * j];
        ps[j] = Product{&kFormats[fmt], (const u8*)n.p[2 + 2 * j], n.i[5 + 3 * j], N, K,
                        (const float*)n.p[0], K, M, (float*)n.p[1 + 2 * j], N, 0, 1};
    }
    return gemm_rows_shared_x(ps, count, (int)n.i[3]);
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
