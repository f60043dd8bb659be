// Products with a weight kept in its blocks, decoded panel by panel right before the
// product on that panel, so no f32 copy of the weight ever exists:
//
//   matmul_nt: y[M, N] = x[M, K] . W[N, K]^T    (forward, recompute; W's rows are outputs)
//   matmul_nn: y[M, K] = g[M, N] . W[N, K]      (the input gradient through W)
//
// One micro-kernel serves both: C[MR, NR] += A[MR, kk] . B[kk, NR], A read by broadcast
// from its rows (x or g as they lie), B a decoded panel of W in vector rows, C held in
// registers over a run of kk and loaded/stored between runs. Every element of C is one
// fused multiply-add chain in k (or n) order from 0 up, whatever the panel sizes and the
// thread that computes it: the result does not depend on the number of threads.
//
// matmul_nt: a task is a strip of NR rows of W. Its thread decodes KC columns of those rows
// at a time (transposed into a [KC][NR] panel: KC x NR floats, 32 KiB with AVX-512, stays
// in L1/L2) and runs the kernel over every row block of x, so each weight is decoded once
// per product. matmul_nn: a task is a slice of the output's columns (a whole number of
// blocks of W's rows); its thread decodes PN rows of W's slice at a time ([PN][slice]) and
// the kernel sums over those rows for every row block of g; when there are fewer slices
// than threads can share, the rows of g are split as well (each split decodes the slice
// again). The per-thread panels are the engine's bounded scratch.

static const int KC = 256;   // columns of W per forward panel (a K-quant block)
static const int PN = 256;   // rows of W per backward panel

template <int R>
static inline void micro(int64_t kk, const float* A, int64_t lda, const float* B, int64_t ldb,
                         float* C, int64_t ldc, bool first, int cols) {
    Vec c0[R], c1[R];
    if (first) {
        for (int r = 0; r < R; r++) c0[r] = c1[r] = vzero();
    } else if (cols == NR) {
        for (int r = 0; r < R; r++) {
            c0[r] = vload(C + r * ldc);
            c1[r] = vload(C + r * ldc + VL);
        }
    } else {
        float tmp[NR] = {0};
        for (int r = 0; r < R; r++) {
            for (int j = 0; j < cols; j++) tmp[j] = C[r * ldc + j];
            c0[r] = vload(tmp);
            c1[r] = vload(tmp + VL);
        }
    }
    for (int64_t k = 0; k < kk; k++) {
        const Vec b0 = vload(B + k * ldb), b1 = vload(B + k * ldb + VL);
        for (int r = 0; r < R; r++) {
            const Vec a = vset1(A[r * lda + k]);
            c0[r] = vfma(a, b0, c0[r]);
            c1[r] = vfma(a, b1, c1[r]);
        }
    }
    if (cols == NR) {
        for (int r = 0; r < R; r++) {
            vstore(C + r * ldc, c0[r]);
            vstore(C + r * ldc + VL, c1[r]);
        }
    } else {
        float tmp[NR];
        for (int r = 0; r < R; r++) {
            vstore(tmp, c0[r]);
            vstore(tmp + VL, c1[r]);
            for (int j = 0; j < cols; j++) C[r * ldc + j] = tmp[j];
        }
    }
}

typedef void (*MicroFn)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool, int);

// micro<r> for r = 1..MR (the last row block of A may be short; MR is at most 12).
static MicroFn micro_rows(int r) {
    static const MicroFn table[] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>,
                                    micro<6>, micro<7>, micro<8>, micro<9>, micro<10>,
                                    micro<11>, micro<12>};
    return table[r];
}

// C[M, cols] (+)= A[M, kk] . B[kk, cols] over every row block of A.
static inline void rows_times_panel(int64_t M, int64_t kk, const float* A, int64_t lda, const float* B,
                                    int64_t ldb, float* C, int64_t ldc, bool first, int cols) {
    for (int64_t m = 0; m < M; m += MR) {
        const int r = (int)(M - m < MR ? M - m : MR);
        micro_rows(r)(kk, A + m * lda, lda, B, ldb, C + m * ldc, ldc, first, cols);
    }
}

struct Product {
    const Format* f;
    const u8* w;          // W's blocks: N rows of row_bytes
    int64_t row_bytes, N, K;
    const float* a;       // x [M, K] (nt) or g [M, N] (nn), rows lda apart
    int64_t lda, M;
    float* c;             // y [M, N] (nt) or [M, K] (nn), rows ldc apart
    int64_t ldc;
    int64_t slice, splits;  // nt: strips per task; nn: output columns per task, row splits
};

// Per-thread scratch, grown on demand (the panels below: tens of KiB a thread).
static thread_local std::vector<float> t_scratch;

static float* scratch(size_t floats) {
    if (t_scratch.size() < floats) t_scratch.resize(floats);
    return t_scratch.data();
}

static void nt_strip(const Product& p, int64_t n0) {
    // The strip's whole K as one [K][NR] panel (decoded KC columns of its rows at a time,
    // then transposed), so each row block of x runs the kernel once over all of K: C in
    // registers from the first k to the last, never reloaded from y (whose rows lie N
    // apart: a reload per KC touched a page a row).
    const int cols = (int)(p.N - n0 < NR ? p.N - n0 : NR);
    float* rows = scratch((size_t)NR * KC + (size_t)NR * p.K);
    float* panel = rows + (size_t)NR * KC;
    for (int64_t k0 = 0; k0 < p.K; k0 += KC) {
        const int64_t kk = p.K - k0 < KC ? p.K - k0 : KC;
        for (int j = 0; j < cols; j++)
            decode_row_part(*p.f, p.w + (n0 + j) * p.row_bytes, k0, k0 + kk, rows + (size_t)j * KC);
        for (int64_t k = 0; k < kk; k++) {
            float* dst = panel + (k0 + k) * NR;
            for (int j = 0; j < cols; j++) dst[j] = rows[(size_t)j * KC + k];
            for (int j = cols; j < NR; j++) dst[j] = 0.0f;
        }
    }
    rows_times_panel(p.M, p.K, p.a, p.lda, panel, NR, p.c + n0, p.ldc, true, cols);
}

static void nn_task(void* ctx, int64_t task, int) {
    const Product& p = *(const Product*)ctx;
    const int64_t slice_i = task / p.splits, split = task % p.splits;
    const int64_t k0 = slice_i * p.slice, kk = p.K - k0 < p.slice ? p.K - k0 : p.slice;
    const int64_t per = (p.M + p.splits - 1) / p.splits;
    const int64_t m0 = split * per, m1 = m0 + per < p.M ? m0 + per : p.M;
    if (m0 >= m1) return;
    const int64_t ld = (kk + NR - 1) / NR * NR;   // whole vectors; the tail stays zero
    // The panel of W, and g's columns n0..n0 + PN copied together ([rows][PN]): g's rows lie
    // N apart (151,936 floats for a head), a page each.
    float* panel = scratch((size_t)PN * ld + (size_t)(m1 - m0) * PN);
    float* gp = panel + (size_t)PN * ld;
    for (int64_t n0 = 0; n0 < p.N; n0 += PN) {
        const int64_t nn = p.N - n0 < PN ? p.N - n0 : PN;
        for (int64_t i = 0; i < nn; i++) {
            float* dst = panel + i * ld;
            decode_row_part(*p.f, p.w + (n0 + i) * p.row_bytes, k0, k0 + kk, dst);
            for (int64_t j = kk; j < ld; j++) dst[j] = 0.0f;
        }
        for (int64_t m = m0; m < m1; m++)
            std::memcpy(gp + (m - m0) * PN, p.a + m * p.lda + n0, (size_t)nn * 4);
        for (int64_t j = 0; j < kk; j += NR) {
            const int cols = (int)(kk - j < NR ? kk - j : NR);
            rows_times_panel(m1 - m0, nn, gp, PN, panel + j, ld, p.c + m0 * p.ldc + k0 + j,
                             p.ldc, n0 == 0, cols);
        }
    }
}

// A task is a run of neighbouring strips (p.slice of them), so the threads write apart:
// strips handed out one by one alternate between threads, whose stores then share the
// cache lines at the strips' edges.
static void nt_task(void* ctx, int64_t task, int) {
    const Product& p = *(const Product*)ctx;
    for (int64_t n0 = task * p.slice * NR; n0 < p.N && n0 < (task + 1) * p.slice * NR; n0 += NR)
        nt_strip(p, n0);
}

static void matmul_nt(Product& p) {
    const int64_t strips = (p.N + NR - 1) / NR, per = strips / (4 * pool_threads());
    p.slice = per < 1 ? 1 : per;
    pool_run((strips + p.slice - 1) / p.slice, nt_task, &p);
}

static void matmul_nn(Product& p) {
    // Slices of the output: a whole number of W's blocks, at most about 256 columns, and at
    // least two per thread when K allows, of equal widths where it divides (K = 896 on 2
    // threads: four of 224); when K is too narrow for that the rows of g are split as well.
    const int64_t qk = p.f->qk, threads = pool_threads();
    int64_t want = (p.K + 255) / 256;
    if (want < 2 * threads) want = 2 * threads;
    int64_t slice = ((p.K + want - 1) / want + qk - 1) / qk * qk;
    if (slice > p.K) slice = p.K;
    const int64_t slices = (p.K + slice - 1) / slice;
    p.slice = slice;
    p.splits = 1;
    while (slices * p.splits < 2 * threads && p.splits * MR < p.M) p.splits++;
    pool_run(slices * p.splits, nn_task, &p);
}
