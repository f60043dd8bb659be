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
// the kernel sums over those rows for every row block of g (read in place, or copied a
// panel's columns at a time where g's rows lie far apart); when there are fewer slices
// than threads can share, the rows of g are split as well (each split decodes the slice
// again). The per-thread panels are the engine's bounded scratch.

static const int KC = 256;   // columns of W per forward panel (a K-quant block)
static const int PN = 256;   // rows of W per backward panel
// g's rows are read where they lie when at most this many floats apart (a LoRA step's g:
// 1,536-14,336 wide; copying every panel's columns cost each of the slices' tasks the same
// copy, 3% of SmolLM2's step); farther apart (a head's: a vocabulary wide, a page a row)
// each task copies its panel's columns together.
static const int64_t kGInPlace = 16384;

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
    int64_t slice, splits;  // nt: strips per task; nn: slices of the output, row splits
    const float* add = nullptr;   // matmul_add: c = add + alpha c (rows ldc apart), or null
    float alpha = 1.0f;
};

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

// The epilogue of a task's finished tile, while the tile is still in the core's cache (a
// pass over the whole of c afterwards reads it back from memory: +8-15% of the product).
static inline void tile_epilogue(const Product& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (p.add) gemm_epilogue(p.c, p.ldc, p.add, p.ldc, p.alpha, m0, m1, n0, n1);
}

// Per-thread scratch, grown on demand (the panels below: tens of KiB a thread).
static thread_local std::vector<float> t_scratch;

static float* scratch(size_t floats) {
    if (t_scratch.size() < floats) t_scratch.resize(floats);
    return t_scratch.data();
}

// An 8 x 8 block of floats transposed: dst[i * ldd + r] = src[r * lds + i]. Three rounds
// of two-vector shuffles (GCC's generic vectors: AVX's unpck/shufps/perm2f128, NEON's
// zip/uzp), a value moved, never computed. The scalar copy it replaces, a strided load and
// a store per weight, was 2-3x the whole decode and product of a strip for a few rows.
typedef float v8f __attribute__((vector_size(32)));

static inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    v8f r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) std::memcpy(&r[i], src + i * lds, 32);
    for (int i = 0; i < 8; i += 2) {   // pairs of rows interleaved: (r0 r1) by twos, by halves
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {   // four rows' elements 2c..2c+1 side by side
            u[i + 2 * h] = __builtin_shufflevector(t[i + h], t[i + 2 + h], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * h + 1] = __builtin_shufflevector(t[i + h], t[i + 2 + h], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int c = 0; c < 4; c++) {   // rows 0-3's and 4-7's halves: columns c and c + 4
        const v8f lo = __builtin_shufflevector(u[c], u[4 + c], 0, 1, 2, 3, 8, 9, 10, 11);
        const v8f hi = __builtin_shufflevector(u[c], u[4 + c], 4, 5, 6, 7, 12, 13, 14, 15);
        std::memcpy(dst + c * ldd, &lo, 32);
        std::memcpy(dst + (c + 4) * ldd, &hi, 32);
    }
}

// rows [cols][kk] (rows ld apart) into panel [kk][NR], the columns past cols zero; whole
// strips by 8 x 8 blocks where NR is a multiple of 8 (not the scalar build's NR = 2).
static void rows_to_panel(const float* rows, int64_t ld, int cols, int64_t kk, float* panel) {
    int64_t k = 0;
    if (cols == NR && NR % 8 == 0)
        for (; k + 8 <= kk; k += 8)
            for (int j = 0; j < NR; j += 8) transpose8(rows + j * ld + k, ld, panel + k * NR + j, NR);
    for (; k < kk; k++) {
        float* dst = panel + k * NR;
        for (int j = 0; j < cols; j++) dst[j] = rows[j * ld + k];
        for (int j = cols; j < NR; j++) dst[j] = 0.0f;
    }
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
        rows_to_panel(rows, KC, cols, kk, panel + k0 * NR);
    }
    rows_times_panel(p.M, p.K, p.a, p.lda, panel, NR, p.c + n0, p.ldc, true, cols);
    tile_epilogue(p, 0, p.M, n0, n0 + cols);
}

static void nn_task(void* ctx, int64_t task, int) {
    const Product& p = *(const Product*)ctx;
    const int64_t slice_i = task / p.splits, split = task % p.splits;
    // slices of q or q + 1 of W's blocks, the wider ones first (matmul_nn)
    const int64_t qk = p.f->qk, blocks = (p.K + qk - 1) / qk;
    const int64_t q = blocks / p.slice, r = blocks % p.slice;
    const int64_t k0 = (slice_i * q + (slice_i < r ? slice_i : r)) * qk;
    const int64_t k1 = k0 + (q + (slice_i < r)) * qk, kk = (k1 < p.K ? k1 : p.K) - k0;
    const int64_t per = (p.M + p.splits - 1) / p.splits;
    const int64_t m0 = split * per, m1 = m0 + per < p.M ? m0 + per : p.M;
    if (m0 >= m1) return;
    const int64_t ld = (kk + NR - 1) / NR * NR;   // whole vectors; the tail stays zero
    // The panel of W, and (g's rows far apart: kGInPlace) g's columns n0..n0 + PN copied
    // together ([rows][PN]).
    float* panel = scratch((size_t)PN * ld + (size_t)(m1 - m0) * PN);
    float* gp = panel + (size_t)PN * ld;
    const bool in_place = p.lda <= kGInPlace;
    for (int64_t n0 = 0; n0 < p.N; n0 += PN) {
        const int64_t nn = p.N - n0 < PN ? p.N - n0 : PN;
        for (int64_t i = 0; i < nn; i++) {
            float* dst = panel + i * ld;
            decode_row_part(*p.f, p.w + (n0 + i) * p.row_bytes, k0, k0 + kk, dst);
            for (int64_t j = kk; j < ld; j++) dst[j] = 0.0f;
        }
        if (!in_place)
            for (int64_t m = m0; m < m1; m++)
                std::memcpy(gp + (m - m0) * PN, p.a + m * p.lda + n0, (size_t)nn * 4);
        const float* a = in_place ? p.a + m0 * p.lda + n0 : gp;
        const int64_t lda = in_place ? p.lda : PN;
        for (int64_t j = 0; j < kk; j += NR) {
            const int cols = (int)(kk - j < NR ? kk - j : NR);
            rows_times_panel(m1 - m0, nn, a, lda, panel + j, ld, p.c + m0 * p.ldc + k0 + j,
                             p.ldc, n0 == 0, cols);
        }
    }
    tile_epilogue(p, m0, m1, k0, k0 + kk);
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
    // Slices of the output (p.slice of them): a whole number of W's blocks each, at most
    // about 256 columns, and at least two per thread when K allows; their widths differ by
    // one block at most, the wider first, so the threads' shares come out even (K = 576 in
    // blocks of 32 on 2 threads: 160, 160, 128, 128, where widths rounded up gave 160, 160,
    // 160, 96 and one thread a tenth more than the other); when K is too narrow for that
    // the rows of g are split as well.
    const int64_t qk = p.f->qk, threads = pool_threads(), blocks = (p.K + qk - 1) / qk;
    int64_t slices = (p.K + 255) / 256;
    if (slices < 2 * threads) slices = 2 * threads;
    if (slices > blocks) slices = blocks;
    p.slice = slices;
    p.splits = 1;
    while (slices * p.splits < 2 * threads && p.splits * MR < p.M) p.splits++;
    pool_run(slices * p.splits, nn_task, &p);
}
