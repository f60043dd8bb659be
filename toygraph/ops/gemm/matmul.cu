// Batched matmul, 64x64 output tiles, 16-deep k slices in shared memory, 256 threads
// each computing 4x4 outputs. A(m, k) = a[m*sam + k*sak] and B(k, n) = b[k*sbk + n*sbn],
// so transposed operands are just other strides. Batch z's operand offsets come from
// `batch` (output batch dims; a's strides in sa, b's in sb; 0 for broadcast dims; the
// host splits a grouped-query dim into (kv_heads, group) with b's group stride 0).
// Each output is one thread's sequential sum over k: deterministic. tg_matmul_acc adds
// that sum to what `out` holds (out += a @ b), so a sum over k split into launches (the
// row chunks of linear_cross_entropy's dw) adds chunk by chunk, in launch order.

// Tile sizes MM_BM x MM_BN, MM_BK and MM_THREADS come from toygraph/ops/lowering/constants.py.

// One 16-deep k slice of the staged tiles into this thread's 4x4 outputs. Shared by the
// f32 and block-format matmuls (qmatmul.cu), so both sum in exactly the same order.
__device__ __forceinline__ void tg_mm_tile_fma(const float (*As)[MM_BM + 1],
                                               const float (*Bs)[MM_BN + 1],
                                               float (&acc)[4][4], int tx, int ty) {
#pragma unroll
    for (int kk = 0; kk < MM_BK; ++kk) {
        float ar[4], br[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) ar[i] = As[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) br[j] = Bs[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
    }
}

// This thread's 4x4 outputs, zeroed; and stored into C [M, N] (row-major) inside the
// bounds, for the tile at (m0, n0), or added to what C holds (ACC). Shared by the tiled
// kernels (here, qmatmul.cu, experts.cu).
__device__ __forceinline__ void tg_mm_zero(float (&acc)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
}

template <bool ACC = false>
__device__ __forceinline__ void tg_mm_store(float* C, const float (&acc)[4][4], int m0, int n0,
                                            int M, int N, int tx, int ty) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int gm = m0 + ty + 16 * i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int gn = n0 + tx + 16 * j;
            if (gn < N) {
                float* c = C + (long long)gm * N + gn;
                *c = ACC ? __fadd_rn(*c, acc[i][j]) : acc[i][j];
            }
        }
    }
}

// The one 64x64 tile loop every f32 CUDA-core product runs (tg_matmul here, the block-format
// weights of qmatmul.cu, the experts' products of experts.cu): for each MM_BK-deep k slice
// the 256 threads stage A(m, k) and B(k, n) through the caller's loaders, which take tile-
// local m (or n) and the global k and return 0 outside the matrices, then one
// tg_mm_tile_fma. The threads walk A with k fastest (m fastest: A_M_FASTEST, a^T read
// along a's rows) and B with n fastest (k fastest: B_K_FASTEST, a weight read along its
// rows), so every output is the same fmaf chain over k, in increasing order, whatever the
// loaders read from.
template <bool A_M_FASTEST, bool B_K_FASTEST, class LoadA, class LoadB>
__device__ __forceinline__ void tg_mm_tile_loop(float (&acc)[4][4], int K, LoadA load_a,
                                                LoadB load_b) {
    __shared__ float As[MM_BK][MM_BM + 1];
    __shared__ float Bs[MM_BK][MM_BN + 1];
    int t = threadIdx.x, tx = t % 16, ty = t / 16;
    tg_mm_zero(acc);
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            int idx = t + MM_THREADS * r;
            int am = A_M_FASTEST ? idx % MM_BM : idx / MM_BK;
            int ak = A_M_FASTEST ? idx / MM_BM : idx % MM_BK;
            As[ak][am] = load_a(am, k0 + ak);
            int bn = B_K_FASTEST ? idx / MM_BK : idx % MM_BN;
            int bk = B_K_FASTEST ? idx % MM_BK : idx / MM_BN;
            Bs[bk][bn] = load_b(k0 + bk, bn);
        }
        __syncthreads();
        tg_mm_tile_fma(As, Bs, acc, tx, ty);
        __syncthreads();
    }
}

template <bool ACC>
__device__ __forceinline__ void tg_matmul_tiles(float* out, const float* a, const float* b,
                                                int M, int N, int K, int sam, int sak, int sbk,
                                                int sbn, int nbatch, const Strided& batch) {
    int t = threadIdx.x, tx = t % 16, ty = t / 16;
    int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    for (int z = blockIdx.z; z < nbatch; z += gridDim.z) {
        int oa, ob;
        tg_offsets(batch, z, oa, ob);
        const float* A = a + oa;
        const float* B = b + ob;
        float acc[4][4];
        tg_mm_tile_loop<false, false>(
            acc, K,
            [&](int am, int gk) {
                int gm = m0 + am;
                return (gm < M && gk < K) ? A[gm * sam + gk * sak] : 0.0f;
            },
            [&](int gk, int bn) {
                int gn = n0 + bn;
                return (gn < N && gk < K) ? B[gk * sbk + gn * sbn] : 0.0f;
            });
        tg_mm_store<ACC>(out + (long long)z * M * N, acc, m0, n0, M, N, tx, ty);
    }
}

#define TG_MM_ARGS float* out, const float* a, const float* b, int M, int N, int K, int sam, \
                   int sak, int sbk, int sbn, int nbatch, Strided batch

extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_matmul(TG_MM_ARGS) {
    tg_matmul_tiles<false>(out, a, b, M, N, K, sam, sak, sbk, sbn, nbatch, batch);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_matmul_acc(TG_MM_ARGS) {
    tg_matmul_tiles<true>(out, a, b, M, N, K, sam, sak, sbk, sbn, nbatch, batch);
}

// matmul_add's epilogue where the product's kernel has none (every path but tc_gemm.cu's):
// out = add + alpha * out over the product already in out, rounded as matmul, scale, add
// would round it (__fmul_rn, then __fadd_rn: never an fma).
extern "C" __global__ void tg_matmul_add_epilogue(float* out, const float* add, float alpha,
                                                  int n) {
    TG_GRID_LOOP(i, n) out[i] = __fadd_rn(add[i], __fmul_rn(alpha, out[i]));
}
