// Matmuls that read a frozen weight W [rows, cols] in its GGUF block
// format (row r is `row_bytes` bytes of blocks) and dequantize it tile by tile with the
// decode functions of blocks.cuh, so no f32 copy of W ever exists on the device.
//
//   tg_qmm_nt_<fmt>: out[M, N] = a[M, K] @ W^T, W [N, K]   (a linear layer's forward)
//   tg_qmm_nn_<fmt>: out[M, N] = a[M, K] @ W,   W [K, N]   (its input gradient dX = dY @ W)
//
// `a` is contiguous (batch axes folded into M by the host). The tiling is tg_matmul's:
// 64x64 output tiles, 16-deep k slices in shared memory, 256 threads of 4x4 outputs, each
// output one thread's fmaf chain over k in increasing order, so the result is
// deterministic and bit-identical to tg_matmul on the dequantized weight.

template <class F, bool NT>
__device__ __forceinline__ void tg_qmm(float* out, const float* a, const unsigned char* w,
                                       int M, int N, int K, int row_bytes) {
    int t = threadIdx.x, tx = t % 16, ty = t / 16;
    int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    float acc[4][4];
    tg_mm_tile_loop<false, NT>(   // NT: B(k, n) = W[n][k], walked along W's rows
        acc, K,
        [&](int am, int gk) {
            int gm = m0 + am;
            return (gm < M && gk < K) ? a[(long long)gm * K + gk] : 0.0f;
        },
        [&](int gk, int bn) {
            int gn = n0 + bn;
            if (gn >= N || gk >= K) return 0.0f;
            return NT ? tg_dequant_at<F>(w + (long long)gn * row_bytes, gk)
                      : tg_dequant_at<F>(w + (long long)gk * row_bytes, gn);
        });
    tg_mm_store(out, acc, m0, n0, M, N, tx, ty);
}

#define TG_QMM_ARGS float* out, const float* a, const unsigned char* w, int M, int N, int K, int row_bytes

// tg_qmm_nt_<fmt> and tg_qmm_nn_<fmt>, one each per block format of TG_BLOCK_FORMATS.
#define TG_QMM_KERNELS(fmt, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_qmm_nt_##fmt(TG_QMM_ARGS) { \
        tg_qmm<Tg##NAME, true>(out, a, w, M, N, K, row_bytes);                            \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_qmm_nn_##fmt(TG_QMM_ARGS) { \
        tg_qmm<Tg##NAME, false>(out, a, w, M, N, K, row_bytes);                           \
    }
TG_BLOCK_FORMATS(TG_QMM_KERNELS)
