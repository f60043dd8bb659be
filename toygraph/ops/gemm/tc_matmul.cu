// Tensor-core matmuls for the mixed-precision modes (CudaBackend dtype "bf16" / "tf32"):
// f32 operands are read from global memory, rounded to bf16 (round to nearest even) or
// tf32 (round to nearest, ties away) while being staged in shared memory, multiplied with
// mma.sync (m16n8k16 bf16 / m16n8k8 tf32, both sm_80+ and valid on sm_90) and accumulated
// in f32. Block-format weights are decoded (blocks.cuh) and rounded the same way, so no
// f32 copy of them exists. Inline PTX only: NVRTC needs no toolkit header.
//
// Tiling (tc_layout.cuh): 128 x 128 output tiles per block of 8 warps, each warp 64 x 32;
// k slices of 32 (bf16) / 16 (tf32) double-buffered in shared memory, the next slice
// fetched into registers while the tensor cores work on the current one. Out-of-range
// rows/columns/k are staged as zeros. Each output is one fixed chain of mma over k slices
// in increasing order (no split-K, no atomics): deterministic run to run.
//
//   tg_tc_matmul_<p>: tg_matmul's arguments (strided A(m,k), B(k,n), batch walk).
//   tg_tc_qmm_{nt,nn}_<fmt>_<p>: qmatmul.cu's arguments (a @ W^T / a @ W, W in blocks).

struct TcBF16 {
    static constexpr int BK = TC_BF16_BK, LD = TC_BF16_LD, KSTEP = 16;
    typedef unsigned short elem;
    static __device__ __forceinline__ elem cvt(float x) {
#ifdef TG_HOST
        return tg_host::cvt_rn_bf16(x);
#else
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
#endif
    }
    // Register r of the A / B fragment: two consecutive k of one row, one 32-bit load.
    static __device__ __forceinline__ unsigned a_reg(const elem* s, int lane, int r, int kk) {
        int row, k;
        tg_bf16_a_frag(lane, r, row, k);
        return *reinterpret_cast<const unsigned*>(s + row * LD + kk + k);
    }
    static __device__ __forceinline__ unsigned b_reg(const elem* s, int lane, int r, int kk) {
        int n, k;
        tg_bf16_b_frag(lane, r, n, k);
        return *reinterpret_cast<const unsigned*>(s + n * LD + kk + k);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {
#ifdef TG_HOST
        tg_host::mma<16>(c, a, b);
#else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
    }
};

struct TcTF32 {
    static constexpr int BK = TC_TF32_BK, LD = TC_TF32_LD, KSTEP = 8;
    typedef unsigned int elem;
    static __device__ __forceinline__ elem cvt(float x) {
#ifdef TG_HOST
        return tg_host::cvt_rna_tf32(x);
#else
        unsigned u;
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
        return u;
#endif
    }
    static __device__ __forceinline__ unsigned a_reg(const elem* s, int lane, int r, int kk) {
        int row, k;
        tg_tf32_a_frag(lane, r, row, k);
        return s[row * LD + kk + k];
    }
    static __device__ __forceinline__ unsigned b_reg(const elem* s, int lane, int r, int kk) {
        int n, k;
        tg_tf32_b_frag(lane, r, n, k);
        return s[n * LD + kk + k];
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {
#ifdef TG_HOST
        tg_host::mma<8>(c, a, b);
#else
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
    }
};

// Operands seen as X(row, k): A with row = m, B with row = n.
// PREFETCH: fetch the next k slice before the current one's mma (plain loads), or after
// them (block-format decoding, whose temporaries on top of the accumulators would spill).
struct TcStrided {           // X(r, k) = p[r*sr + k*sk]: dense f32, any transpose
    static constexpr bool PREFETCH = true;
    const float* p;
    int sr, sk;
    __device__ __forceinline__ int kfast() const { return sk == 1; }
    __device__ __forceinline__ float at(int r, int k) const {
        return p[(long long)r * sr + (long long)k * sk];
    }
};

template <class F>
struct TcBlocksNT {          // B(n, k) = W[n][k]: x @ W^T, walk along W's rows
    static constexpr bool PREFETCH = false;
    const unsigned char* w;
    int row_bytes;
    __device__ __forceinline__ int kfast() const { return 1; }
    __device__ __forceinline__ float at(int n, int k) const {
        return tg_dequant_at<F>(w + (long long)n * row_bytes, k);
    }
};

template <class F>
struct TcBlocksNN {          // B(n, k) = W[k][n]: dy @ W, walk across W's rows
    static constexpr bool PREFETCH = false;
    const unsigned char* w;
    int row_bytes;
    __device__ __forceinline__ int kfast() const { return 0; }
    __device__ __forceinline__ float at(int n, int k) const {
        return tg_dequant_at<F>(w + (long long)k * row_bytes, n);
    }
};

// Global -> registers: this thread's share of the rows x BK slice at (r0, k0), zeros
// outside [0, R) x [0, K).
template <class P, int ROWS, class Op>
__device__ __forceinline__ void tg_tc_fetch(const Op& op, int kf, int r0, int k0, int R, int K,
                                            float* regs) {
    constexpr int PER = ROWS * P::BK / TC_THREADS;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        int r, k;
        tg_tc_stage_coord(threadIdx.x + TC_THREADS * i, P::BK, ROWS, kf, r, k);
        int gr = r0 + r, gk = k0 + k;
        regs[i] = (gr < R && gk < K) ? op.at(gr, gk) : 0.0f;
    }
}

// Global -> shared memory directly, element by element (the non-PREFETCH operands).
template <class P, int ROWS, class Op>
__device__ __forceinline__ void tg_tc_fetch_stash(const Op& op, int kf, int r0, int k0, int R,
                                                  int K, typename P::elem* s) {
    constexpr int PER = ROWS * P::BK / TC_THREADS;
#pragma unroll 4
    for (int i = 0; i < PER; ++i) {
        int r, k;
        tg_tc_stage_coord(threadIdx.x + TC_THREADS * i, P::BK, ROWS, kf, r, k);
        int gr = r0 + r, gk = k0 + k;
        s[r * P::LD + k] = P::cvt((gr < R && gk < K) ? op.at(gr, gk) : 0.0f);
    }
}

// Registers -> shared memory, rounded to the tensor-core input type.
template <class P, int ROWS>
__device__ __forceinline__ void tg_tc_stash(typename P::elem* s, int kf, const float* regs) {
    constexpr int PER = ROWS * P::BK / TC_THREADS;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        int r, k;
        tg_tc_stage_coord(threadIdx.x + TC_THREADS * i, P::BK, ROWS, kf, r, k);
        s[r * P::LD + k] = P::cvt(regs[i]);
    }
}

template <class P>
__device__ __forceinline__ void tg_tc_compute(const typename P::elem* As,
                                              const typename P::elem* Bs, int wm, int wn,
                                              int lane, float (&acc)[TC_MI][TC_NI][4]) {
#pragma unroll
    for (int kk = 0; kk < P::BK; kk += P::KSTEP) {
        unsigned a[TC_MI][4], b[TC_NI][2];
#pragma unroll
        for (int i = 0; i < TC_MI; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) a[i][r] = P::a_reg(As + (wm + 16 * i) * P::LD, lane, r, kk);
#pragma unroll
        for (int j = 0; j < TC_NI; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) b[j][r] = P::b_reg(Bs + (wn + 8 * j) * P::LD, lane, r, kk);
#pragma unroll
        for (int i = 0; i < TC_MI; ++i)
#pragma unroll
            for (int j = 0; j < TC_NI; ++j) P::mma(acc[i][j], a[i], b[j]);
    }
}

// A warp's TC_MI x TC_NI accumulator tiles: zeroed, and stored into C [M, N] (row-major)
// at the warp's origin (r0, c0), inside the bounds (shared with tc_gemm.cu).
__device__ __forceinline__ void tg_tc_zero(float (&acc)[TC_MI][TC_NI][4]) {
#pragma unroll
    for (int i = 0; i < TC_MI; ++i)
#pragma unroll
        for (int j = 0; j < TC_NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
}

__device__ __forceinline__ void tg_tc_store(float* C, const float (&acc)[TC_MI][TC_NI][4],
                                            int lane, int r0, int c0, int M, int N) {
#pragma unroll
    for (int i = 0; i < TC_MI; ++i)
#pragma unroll
        for (int j = 0; j < TC_NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int row, col;
                tg_tc_c_frag(lane, r, row, col);
                const int gm = r0 + 16 * i + row, gn = c0 + 8 * j + col;
                if (gm < M && gn < N) C[(long long)gm * N + gn] = acc[i][j][r];
            }
}

// One 128 x 128 tile of C[M, N] = A(m, k) B(n, k)^T at (m0, n0).
template <class P, class OA, class OB>
__device__ __forceinline__ void tg_tc_tile(float* C, const OA& A, const OB& B, int M, int N,
                                           int K, int m0, int n0) {
    __shared__ __align__(16) typename P::elem As[2][TC_BM * P::LD];
    __shared__ __align__(16) typename P::elem Bs[2][TC_BN * P::LD];
    constexpr int PA = TC_BM * P::BK / TC_THREADS, PB = TC_BN * P::BK / TC_THREADS;
    const int lane = threadIdx.x & 31;
    int wm, wn;
    tg_tc_warp_origin(threadIdx.x >> 5, wm, wn);
    const int akf = A.kfast(), bkf = B.kfast();
    float acc[TC_MI][TC_NI][4];
    tg_tc_zero(acc);
    float ra[PA], rb[PB];
    const int ktiles = (K + P::BK - 1) / P::BK;
    if (ktiles > 0) {
        tg_tc_fetch<P, TC_BM>(A, akf, m0, 0, M, K, ra);
        tg_tc_fetch<P, TC_BN>(B, bkf, n0, 0, N, K, rb);
        tg_tc_stash<P, TC_BM>(As[0], akf, ra);
        tg_tc_stash<P, TC_BN>(Bs[0], bkf, rb);
    }
    __syncthreads();
    for (int kt = 0; kt < ktiles; ++kt) {
        const int cur = kt & 1;
        const bool more = kt + 1 < ktiles;
        if (more) {  // in flight while the tensor cores work on slice kt
            tg_tc_fetch<P, TC_BM>(A, akf, m0, (kt + 1) * P::BK, M, K, ra);
            if (OB::PREFETCH) tg_tc_fetch<P, TC_BN>(B, bkf, n0, (kt + 1) * P::BK, N, K, rb);
        }
        tg_tc_compute<P>(As[cur], Bs[cur], wm, wn, lane, acc);
        if (more) {  // the other buffer was last read before the previous barrier
            tg_tc_stash<P, TC_BM>(As[cur ^ 1], akf, ra);
            if (OB::PREFETCH)
                tg_tc_stash<P, TC_BN>(Bs[cur ^ 1], bkf, rb);
            else
                tg_tc_fetch_stash<P, TC_BN>(B, bkf, n0, (kt + 1) * P::BK, N, K, Bs[cur ^ 1]);
        }
        __syncthreads();
    }
    tg_tc_store(C, acc, lane, m0 + wm, n0 + wn, M, N);
}

template <class P>
__device__ __forceinline__ void tg_tc_matmul(float* out, const float* a, const float* b, int M,
                                             int N, int K, int sam, int sak, int sbk, int sbn,
                                             int nbatch, const Strided& batch) {
    const int m0 = blockIdx.y * TC_BM, n0 = blockIdx.x * TC_BN;
    for (int z = blockIdx.z; z < nbatch; z += gridDim.z) {
        int oa, ob;
        tg_offsets(batch, z, oa, ob);
        TcStrided A{a + oa, sam, sak}, B{b + ob, sbn, sbk};
        tg_tc_tile<P>(out + (long long)z * M * N, A, B, M, N, K, m0, n0);
    }
}

template <class P, class F, bool NT>
__device__ __forceinline__ void tg_tc_qmm(float* out, const float* a, const unsigned char* w,
                                          int M, int N, int K, int row_bytes) {
    TcStrided A{a, K, 1};
    const int m0 = blockIdx.y * TC_BM, n0 = blockIdx.x * TC_BN;
    if constexpr (NT) {
        tg_tc_tile<P>(out, A, TcBlocksNT<F>{w, row_bytes}, M, N, K, m0, n0);
    } else {
        tg_tc_tile<P>(out, A, TcBlocksNN<F>{w, row_bytes}, M, N, K, m0, n0);
    }
}

#define TG_TC_MM_ARGS float* out, const float* a, const float* b, int M, int N, int K, int sam, \
    int sak, int sbk, int sbn, int nbatch, Strided batch
extern "C" __global__ void __launch_bounds__(TC_THREADS) tg_tc_matmul_bf16(TG_TC_MM_ARGS) {
    tg_tc_matmul<TcBF16>(out, a, b, M, N, K, sam, sak, sbk, sbn, nbatch, batch);
}
extern "C" __global__ void __launch_bounds__(TC_THREADS) tg_tc_matmul_tf32(TG_TC_MM_ARGS) {
    tg_tc_matmul<TcTF32>(out, a, b, M, N, K, sam, sak, sbk, sbn, nbatch, batch);
}

#define TG_TC_QMM_ARGS float* out, const float* a, const unsigned char* w, int M, int N, int K, \
    int row_bytes

// tg_tc_qmm_{nt,nn}_<fmt>_{bf16,tf32}: four per block format of TG_BLOCK_FORMATS.
#define TG_TC_QMM_KERNELS(fmt, NAME)                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) tg_tc_qmm_nt_##fmt##_bf16(TG_TC_QMM_ARGS) { \
        tg_tc_qmm<TcBF16, Tg##NAME, true>(out, a, w, M, N, K, row_bytes);                 \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) tg_tc_qmm_nn_##fmt##_bf16(TG_TC_QMM_ARGS) { \
        tg_tc_qmm<TcBF16, Tg##NAME, false>(out, a, w, M, N, K, row_bytes);                \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) tg_tc_qmm_nt_##fmt##_tf32(TG_TC_QMM_ARGS) { \
        tg_tc_qmm<TcTF32, Tg##NAME, true>(out, a, w, M, N, K, row_bytes);                 \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) tg_tc_qmm_nn_##fmt##_tf32(TG_TC_QMM_ARGS) { \
        tg_tc_qmm<TcTF32, Tg##NAME, false>(out, a, w, M, N, K, row_bytes);                \
    }
TG_BLOCK_FORMATS(TG_TC_QMM_KERNELS)
