// The bf16 tensor-core GEMM (the bf16 precision's dense matmul; tc_matmul.cu keeps tf32 and
// the block-format weights): bf16 operands staged with cp.async, two stages, fragments
// loaded with ldmatrix, mma.sync m16n8k16 with f32 accumulation. Optional deterministic
// split-K for products with few output tiles and a long k (the weight gradients, K =
// tokens): each split writes its partial tile to its own slice of a scratch, and
// tg_tcg_sum_splits adds the slices in split order.
//
// Operands: canonical bf16 copies written by tg_tcg_to_bf16 from the f32 tensors, an
// activation kept in bf16 that already has the canonical layout as it is (tc_gemm.py's
// `canonical`), or for a block-format weight by
// tg_tcg_deq_{nt,nn}_<fmt> (decoded once per GEMM): A as [matrices][M][Kp], B as
// [matrices][N][Kp] (k contiguous, Kp = K rounded up to 8 and zero-padded, so every row
// is whole 16-byte chunks). Transposed operands are transposed by the copy, so the GEMM
// has one layout. Matrix offsets (batch, broadcast, grouped-query) come from `batch`, in
// elements of these copies.
//
// Tiling: tc_layout.cuh's (128 x 128 output tiles, 8 warps of 64 x 32, 32-deep k slices,
// shared rows TC_BF16_LD = 40 halves apart: 80 bytes, 16-byte aligned for cp.async and
// ldmatrix, and ldmatrix's eight row reads of a matrix fall in distinct bank quads).
// Each 128 x 32 slice is 512 chunks of 16 bytes, two per thread per operand; rows past
// M / N and k past Kp are zero-filled by cp.async (src-size 0).
//
// Fragments (PTX ISA; tc_async.cuh for ldmatrix), lane l:
//   A [m][k]: ldmatrix.x4 with lane l at row l & 15, column 8 (l >> 4) -> a0a1 .. a6a7.
//   B [n][k]: ldmatrix.x4 with lane l at n row (l & 7) + 8 (l >> 4), column 8 ((l >> 3) & 1)
//             -> the b registers of n-tiles n0 (d0, d1) and n0 + 8 (d2, d3).
//   C: c_e at row g + 8 (e >> 1), column 2t + (e & 1) (tg_tc_c_frag).
// Each output is one fixed chain of mma over its k slices in increasing order, and split-K
// sums the partials in a fixed order: bit-identical run to run.
//
// Epilogue (matmul_add): with `add` given, out = add + alpha * C, rounded as a separate
// scale and add would round it (__fmul_rn, then __fadd_rn: no contraction into an fma), so
// the fused node equals matmul, scale, add bit for bit; with splits > 1 the split sum
// applies it to the summed partials.

#define TCG_LD TC_BF16_LD
#define TCG_BK TC_BF16_BK

// X(r, k) -> bf16 dst[r][k], k < Kp, zero past K, X an operand reader (TcScaled below: f32
// or bf16, any transpose, scaled; tc_matmul.cu's TcBlocksNT/NN: a block-format weight,
// decoded). A 32 x 32 tile through shared memory, read along the source's contiguous axis
// and written along k, so a transposing copy is coalesced on both sides. 256 threads.
template <class Op>
__device__ __forceinline__ void tcg_copy_tile(unsigned short* dst, const Op& op, int R, int K,
                                              int Kp, float (*tile)[33]) {
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int k0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    const bool kfast = op.kfast();
#pragma unroll
    for (int j = 0; j < 32; j += 8) {   // (row, k) of the tile this thread reads
        const int r = kfast ? ty + j : tx, k = kfast ? tx : ty + j;
        const int gr = r0 + r, gk = k0 + k;
        tile[r][k] = gr < R && gk < K ? op.at(gr, gk) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 32; j += 8) {
        const int gr = r0 + ty + j, gk = k0 + tx;
        if (gr < R && gk < Kp) dst[(long long)gr * Kp + gk] = TcBF16::cvt(tile[ty + j][tx]);
    }
    __syncthreads();
}

// X(r, k) = scale * p[base + r*sr + k*sk] rounded to f32 (__fmul_rn: a scale node's
// rounding; scale 1 reads p as it is): matmul's scale_a, applied by the copy. p is f32, or
// bf16 when `bf16` is 1 (an activation kept in bf16, cuda/bf16_storage.py: a copy only to
// transpose, pad or scale it).
struct TcScaled {
    const void* p;
    long long base;
    int sr, sk;
    float scale;
    int bf16;
    __device__ __forceinline__ int kfast() const { return sk == 1; }
    __device__ __forceinline__ float at(int r, int k) const {
        return __fmul_rn(scale, tg_ldx(p, base + (long long)r * sr + (long long)k * sk, bf16, 0));
    }
};

// X(r, k) = scale * src[z * mat + r * sr + k * sk] -> bf16 dst[z][r][k] for the nmat
// matrices; src f32, or bf16 with `bf16` 1.
extern "C" __global__ void __launch_bounds__(TG_THREADS) tg_tcg_to_bf16(
    unsigned short* dst, const void* src, int R, int K, int Kp, int sr, int sk, int nmat,
    int mat, float scale, int bf16) {
    __shared__ float tcg_tile_f32[32][33];
    for (int z = blockIdx.z; z < nmat; z += gridDim.z)
        tcg_copy_tile(dst + (long long)z * R * Kp,
                      TcScaled{src, (long long)z * mat, sr, sk, scale, bf16}, R, K, Kp,
                      tcg_tile_f32);
}

// A block-format weight W [rows][cols] (row_bytes per row) decoded once into the GEMM's
// B copy [N][Kp]: "nt" (x @ W^T) B(n, k) = W[n][k], N = rows; "nn" (dy @ W) B(n, k) =
// W[k][n], N = cols, transposed through the tile.
template <class F, bool NT>
__device__ __forceinline__ void tcg_deq(unsigned short* dst, const unsigned char* w, int R,
                                        int K, int Kp, int row_bytes, float (*tile)[33]) {
    if constexpr (NT) {
        tcg_copy_tile(dst, TcBlocksNT<F>{w, row_bytes}, R, K, Kp, tile);
    } else {
        tcg_copy_tile(dst, TcBlocksNN<F>{w, row_bytes}, R, K, Kp, tile);
    }
}

// tg_tcg_deq_nt_<fmt> and tg_tcg_deq_nn_<fmt>, one each per block format of TG_BLOCK_FORMATS
// (blocks.c_defines): the shared tile declared in the kernel, not the template (host_shim.h).
#define TG_TCG_DEQ_ARGS unsigned short* dst, const unsigned char* w, int R, int K, int Kp, \
    int row_bytes
#define TG_TCG_DEQ_KERNELS(fmt, NAME)                                                     \
    extern "C" __global__ void __launch_bounds__(TG_THREADS) tg_tcg_deq_nt_##fmt(TG_TCG_DEQ_ARGS) { \
        __shared__ float tcg_t_nt_##fmt[32][33];                                          \
        tcg_deq<Tg##NAME, true>(dst, w, R, K, Kp, row_bytes, tcg_t_nt_##fmt);             \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(TG_THREADS) tg_tcg_deq_nn_##fmt(TG_TCG_DEQ_ARGS) { \
        __shared__ float tcg_t_nn_##fmt[32][33];                                          \
        tcg_deq<Tg##NAME, false>(dst, w, R, K, Kp, row_bytes, tcg_t_nn_##fmt);            \
    }
TG_BLOCK_FORMATS(TG_TCG_DEQ_KERNELS)

// Rows [r0, r0 + 128) x k [k0, k0 + 32) of X [R][Kp] into S[128][LD] with cp.async.
__device__ __forceinline__ void tcg_issue(unsigned short* S, const unsigned short* X, int r0,
                                          int R, int k0, int Kp) {
#pragma unroll
    for (int i = 0; i < TC_BM * TCG_BK / 8 / TC_THREADS; ++i) {
        const int c = threadIdx.x + TC_THREADS * i;
        const int r = c >> 2, kc = (c & 3) * 8;
        const bool in = r0 + r < R && k0 + kc < Kp;
        tg_cp_async16(S + r * TCG_LD + kc, X + (in ? (long long)(r0 + r) * Kp + k0 + kc : 0),
                      in ? 16 : 0);
    }
}

// A k-major operand (X [K][ld] in global memory: rows of k, r contiguous, ld a multiple of
// 8 -- a bf16 activation read transposed, e.g. x of dW = x^T dy) staged as it lies: k rows
// [k0, k0 + 32) x r [r0, r0 + 128) into S[32][TCG_LDT] with cp.async, k past K zero-filled
// (r past R only feeds outputs that are never stored).
#define TCG_LDT (TC_BM + 8)   // 272-byte rows: 16-byte aligned, ldmatrix's 8 rows in 8 bank quads
__device__ __forceinline__ void tcg_issue_km(unsigned short* S, const unsigned short* X, int r0,
                                             int R, int k0, int K, int ld) {
#pragma unroll
    for (int i = 0; i < TC_BM * TCG_BK / 8 / TC_THREADS; ++i) {
        const int c = threadIdx.x + TC_THREADS * i;
        const int k = c >> 4, rc = (c & 15) * 8;
        const bool in = k0 + k < K && r0 + rc < R;
        tg_cp_async16(S + k * TCG_LDT + rc, X + (in ? (long long)(k0 + k) * ld + r0 + rc : 0),
                      in ? 16 : 0);
    }
}

// One staged 32-deep slice into the warp's 64 x 32 accumulators. Per 16-deep step the B
// fragments of the warp's four n-tiles are loaded first, then one m-tile's A fragment at a
// time (12 fragment registers live, not 24: the kernel fits 128 registers, two blocks
// per SM, without spilling). TA / TB: that operand is staged k-major (tcg_issue_km) and its
// fragments come from ldmatrix.trans: matrix i of lane l is the 8 x 8 block at (8 (i & 1),
// 8 (i >> 1)) of (m, k) for A -- a0..a3 as m16n8k16 wants them -- and at (8 (i >> 1),
// 8 (i & 1)) of (n, k) for B; lane l addresses its block's k row l & 7.
template <bool TA, bool TB>
__device__ __forceinline__ void tcg_compute(const unsigned short* As, const unsigned short* Bs,
                                            int wm, int wn, int lane,
                                            float (&acc)[TC_MI][TC_NI][4]) {
#pragma unroll
    for (int kk = 0; kk < TCG_BK; kk += 16) {
        unsigned b[TC_NI][2];
#pragma unroll
        for (int j = 0; j < TC_NI; j += 2) {
            unsigned d[4];
            if (TB)
                tg_ldmatrix<4, true>(d, Bs + (kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * TCG_LDT
                                            + wn + 8 * j + 8 * (lane >> 4));
            else
                tg_ldmatrix<4, false>(d, Bs + (wn + 8 * j + (lane & 7) + 8 * (lane >> 4)) * TCG_LD
                                             + kk + 8 * ((lane >> 3) & 1));
            b[j][0] = d[0], b[j][1] = d[1], b[j + 1][0] = d[2], b[j + 1][1] = d[3];
        }
#pragma unroll
        for (int i = 0; i < TC_MI; ++i) {
            unsigned a[4];
            if (TA)
                tg_ldmatrix<4, true>(a, As + (kk + 8 * (lane >> 4) + (lane & 7)) * TCG_LDT
                                            + wm + 16 * i + 8 * ((lane >> 3) & 1));
            else
                tg_ldmatrix<4, false>(a, As + (wm + 16 * i + (lane & 15)) * TCG_LD + kk
                                             + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < TC_NI; ++j) TcBF16::mma(acc[i][j], a, b[j]);
        }
    }
}

// tg_tc_store with the matmul_add epilogue: C = add + alpha * acc where add is given, else
// alpha * acc (alpha 1: acc itself; otherwise a bf16 operand's scale_a, tc_gemm.py). With
// `bf16` bit 0 add is read in bf16, with TG_OUT_BF16 C is written in bf16 (tensors kept in
// bf16, cuda/bf16_storage.py).
__device__ __forceinline__ void tcg_store(void* C, const float (&acc)[TC_MI][TC_NI][4],
                                          int lane, int r0, int c0, int M, int N,
                                          const void* add, float alpha, int bf16) {
#pragma unroll
    for (int i = 0; i < TC_MI; ++i)
#pragma unroll
        for (int j = 0; j < TC_NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int row, col;
                tg_tc_c_frag(lane, r, row, col);
                const int gm = r0 + 16 * i + row, gn = c0 + 8 * j + col;
                if (gm < M && gn < N) {
                    const long long o = (long long)gm * N + gn;
                    const float v = __fmul_rn(alpha, acc[i][j][r]);
                    tg_stx(C, o, add ? __fadd_rn(tg_ldx(add, o, bf16, 0), v) : v, bf16);
                }
            }
}

// The second product of a dual GEMM (tg_tcg_gemm2_bf16): its A [M][Kp2] and B [N][Kp2]
// copies, whose k slices follow the first product's ktiles1 slices in one accumulation;
// or, for the k-major GEMMs (TA / TB), the true k extent and the operands' row strides.
struct TcgSecond {
    const unsigned short* a;
    const unsigned short* b;
    int kp, ktiles1;
    int K, lda, ldb;
};

// Slice kt of the k range into stage S: the first product's, or past its ktiles1 slices
// (DUAL) the second's; a k-major operand (TA / TB) from its [K][ld] layout.
template <bool DUAL, bool TA, bool TB>
__device__ __forceinline__ void tcg_issue_slice(unsigned short* As, unsigned short* Bs,
                                                const unsigned short* A,
                                                const unsigned short* B, int Kp,
                                                const TcgSecond& two, int kt, int m0, int n0,
                                                int M, int N) {
    if (DUAL && kt >= two.ktiles1) {
        tcg_issue(As, two.a, m0, M, (kt - two.ktiles1) * TCG_BK, two.kp);
        tcg_issue(Bs, two.b, n0, N, (kt - two.ktiles1) * TCG_BK, two.kp);
        return;
    }
    if (TA)
        tcg_issue_km(As, A, m0, M, kt * TCG_BK, two.K, two.lda);
    else
        tcg_issue(As, A, m0, M, kt * TCG_BK, Kp);
    if (TB)
        tcg_issue_km(Bs, B, n0, N, kt * TCG_BK, two.K, two.ldb);
    else
        tcg_issue(Bs, B, n0, N, kt * TCG_BK, Kp);
}

// C[M, N] (row-major) = A B^T over k slices [kt0, kt1) for the tile at (m0, n0) (DUAL: the
// second product's slices after the first's), staged in the kernel's shared arrays tcg_As /
// tcg_Bs (declared in the extern "C" kernel: the host executor only treats a kernel's own
// statics as shared memory, host_shim.h).
template <bool DUAL, bool TA, bool TB>
__device__ __forceinline__ void tcg_tile(void* C, const unsigned short* A,
                                         const unsigned short* B, int M, int N, int Kp,
                                         int kt0, int kt1, int m0, int n0,
                                         const void* add, float alpha, int bf16,
                                         const TcgSecond& two,
                                         unsigned short (*tcg_As)[TC_BM * TCG_LD],
                                         unsigned short (*tcg_Bs)[TC_BN * TCG_LD]) {
    const int lane = threadIdx.x & 31;
    int wm, wn;
    tg_tc_warp_origin(threadIdx.x >> 5, wm, wn);
    float acc[TC_MI][TC_NI][4];
    tg_tc_zero(acc);
    if (kt0 < kt1) {
        tcg_issue_slice<DUAL, TA, TB>(tcg_As[0], tcg_Bs[0], A, B, Kp, two, kt0, m0, n0, M, N);
        tg_cp_async_commit();
    }
    for (int kt = kt0; kt < kt1; ++kt) {
        const int cur = (kt - kt0) & 1;
        if (kt + 1 < kt1) {   // the next slice's copies fly while this one is multiplied
            tcg_issue_slice<DUAL, TA, TB>(tcg_As[cur ^ 1], tcg_Bs[cur ^ 1], A, B, Kp, two,
                                          kt + 1, m0, n0, M, N);
            tg_cp_async_commit();
            tg_cp_async_wait<1>();
        } else {
            tg_cp_async_wait<0>();
        }
        __syncthreads();
        tcg_compute<TA, TB>(tcg_As[cur], tcg_Bs[cur], wm, wn, lane, acc);
        __syncthreads();   // stage cur is refilled by the next iteration's copies
    }
    tcg_store(C, acc, lane, m0 + wm, n0 + wn, M, N, add, alpha, bf16);
}

// tg_offsets with constant indices only: its loop over batch.nd indexes the parameter
// struct by a register, which makes ptxas copy the struct to a local-memory stack frame.
__device__ __forceinline__ void tcg_offsets(const Strided& s, int i, int& oa, int& ob) {
    oa = 0;
    ob = 0;
#pragma unroll
    for (int d = TG_MAXD - 1; d >= 0; --d) {
        if (d < s.nd) {
            const int q = i % s.dims[d];
            i /= s.dims[d];
            oa += q * s.sa[d];
            ob += q * s.sb[d];
        }
    }
}

// z = batch * splits + split is blockIdx.z + gridDim.z * (blockIdx.x / N tiles): grid z
// up to 65535, more in grid x (each block one z: a loop over z costs registers that
// would spill at two blocks per SM). With splits > 1 (nbatch 1) split s covers k slices
// [s * kts, (s + 1) * kts) and writes its partial [M, N] at out + s * M * N; otherwise
// out is the [nbatch, M, N] result (plus alpha times add's, when add is given: splits 1),
// in bf16 when `bf16` says so (splits 1; the partials are f32). DUAL: one matrix (nbatch
// 1), the second product's slices after the first's. TA / TB: k-major operands (one matrix).
template <bool DUAL, bool TA = false, bool TB = false>
__device__ __forceinline__ void tcg_gemm(void* out, const unsigned short* a,
                                         const unsigned short* b, int M, int N, int Kp,
                                         int splits, int kts, int nbatch, const Strided& batch,
                                         const void* add, float alpha, int bf16,
                                         const TcgSecond& two,
                                         unsigned short (*As)[TC_BM * TCG_LD],
                                         unsigned short (*Bs)[TC_BN * TCG_LD]) {
    const int gx = (N + TC_BN - 1) / TC_BN;
    const int z = blockIdx.z + gridDim.z * (blockIdx.x / gx);
    if (z >= nbatch * splits) return;
    const int m0 = blockIdx.y * TC_BM, n0 = (blockIdx.x % gx) * TC_BN;
    const int ktiles = (Kp + TCG_BK - 1) / TCG_BK
                       + (DUAL ? (two.kp + TCG_BK - 1) / TCG_BK : 0);
    const int s = z % splits;
    int oa, ob;
    tcg_offsets(batch, z / splits, oa, ob);
    const int kt0 = s * kts, kt1 = min(ktiles, kt0 + kts);
    const long long oc = (long long)z * M * N;
    void* c = (bf16 >> TG_OUT_BF16) & 1 ? (void*)((unsigned short*)out + oc)
                                        : (void*)((float*)out + oc);
    const void* ad = !add || splits != 1 ? nullptr
                     : bf16 & 1 ? (const void*)((const unsigned short*)add + oc)
                                : (const void*)((const float*)add + oc);
    tcg_tile<DUAL, TA, TB>(c, a + oa, b + ob, M, N, Kp, kt0, kt1, m0, n0, ad, alpha, bf16, two,
                           As, Bs);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) tg_tcg_gemm_bf16(
    void* out, const unsigned short* a, const unsigned short* b, int M, int N, int Kp,
    int splits, int kts, int nbatch, Strided batch, const void* add, float alpha, int bf16) {
    __shared__ __align__(16) unsigned short tcg_As[2][TC_BM * TCG_LD];
    __shared__ __align__(16) unsigned short tcg_Bs[2][TC_BN * TCG_LD];
    tcg_gemm<false>(out, a, b, M, N, Kp, splits, kts, nbatch, batch, add, alpha, bf16,
                    TcgSecond{nullptr, nullptr, 0, 0, 0, 0, 0}, tcg_As, tcg_Bs);
}

// tg_tcg_gemm_bf16 with A (_ta), B (_tb) or both (_tab) read k-major as they lie, X [K][ld]
// (a bf16 activation whose k is its rows: the weight gradients' x^T dy, LoRA's dA and dB),
// so no transposing copy of it is made. One matrix (nbatch 1); K the true k extent.
#define TG_TCG_KM_ARGS void* out, const unsigned short* a, const unsigned short* b, int M, \
    int N, int Kp, int splits, int kts, int nbatch, Strided batch, const void* add, \
    float alpha, int bf16, int K, int lda, int ldb
// (the stages hold a k-major slice too: TCG_BK x TCG_LDT = 4352 <= TC_BM x TCG_LD = 5120)
#define TG_TCG_KM_BODY(A_KM, B_KM)                                                          \
    __shared__ __align__(16) unsigned short tcg_As[2][TC_BM * TCG_LD];                      \
    __shared__ __align__(16) unsigned short tcg_Bs[2][TC_BN * TCG_LD];                      \
    tcg_gemm<false, A_KM, B_KM>(out, a, b, M, N, Kp, splits, kts, nbatch, batch, add, alpha, \
                                bf16, TcgSecond{nullptr, nullptr, 0, 0, K, lda, ldb}, tcg_As, \
                                tcg_Bs)
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) tg_tcg_gemm_ta_bf16(TG_TCG_KM_ARGS) {
    TG_TCG_KM_BODY(true, false);
}
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) tg_tcg_gemm_tb_bf16(TG_TCG_KM_ARGS) {
    TG_TCG_KM_BODY(false, true);
}
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) tg_tcg_gemm_tab_bf16(TG_TCG_KM_ARGS) {
    TG_TCG_KM_BODY(true, true);
}

// out = A B^T + A2 B2^T in one accumulation (a LoRA projection x W^T + s u B^T with s in
// B2's copy, and its backward dx = dy W + du A): one matrix, the base product's output
// never written apart. a2/b2 are [M][Kp2] / [N][Kp2] copies like a and b.
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) tg_tcg_gemm2_bf16(
    void* out, const unsigned short* a, const unsigned short* b, int M, int N, int Kp,
    int splits, int kts, int nbatch, Strided batch, const void* add, float alpha, int bf16,
    const unsigned short* a2, const unsigned short* b2, int Kp2) {
    __shared__ __align__(16) unsigned short tcg_As[2][TC_BM * TCG_LD];
    __shared__ __align__(16) unsigned short tcg_Bs[2][TC_BN * TCG_LD];
    tcg_gemm<true>(out, a, b, M, N, Kp, splits, kts, nbatch, batch, add, alpha, bf16,
                   TcgSecond{a2, b2, Kp2, (Kp + TCG_BK - 1) / TCG_BK, 0, 0, 0}, tcg_As, tcg_Bs);
}

// out[i] = parts[0][i] + parts[1][i] + ... + parts[splits - 1][i], in that order (then
// add[i] + alpha * that, when add is given: the matmul_add epilogue; else alpha * that,
// alpha 1 but for a bf16 operand's scale_a); add in bf16 where
// `bf16` has bit 0 set, out where it has TG_OUT_BF16.
extern "C" __global__ void tg_tcg_sum_splits(void* out, const float* parts, int splits, int n,
                                             const void* add, float alpha, int bf16) {
    TG_GRID_LOOP(i, n) {
        float s = parts[i];
        for (int k = 1; k < splits; ++k) s = __fadd_rn(s, parts[(long long)k * n + i]);
        const float v = __fmul_rn(alpha, s);
        tg_stx(out, i, add ? __fadd_rn(tg_ldx(add, i, bf16, 0), v) : v, bf16);
    }
}
