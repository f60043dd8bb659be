// Mixture-of-experts kernels (ops/experts/): the router's top-k, take_along and its
// scatter, the stable grouping of slots by expert, and the grouped GEMMs that run each
// expert over only the slots that chose it, reading the expert weights either as f32 or
// in their GGUF block format (decoded tile by tile with blocks.cuh, as qmatmul.cu does).
//
// `routes` (group_by_expert's output) is off[E + 1] then perm[R]: expert e's slots are
// perm[off[e] .. off[e + 1]), in slot order; slot s = n * k + j is token n's j-th choice.
// No atomics: every output is written by one thread, every sum runs in a fixed order.

// ids[r, 0..k) = the k largest of x[r, 0..E), largest first, ties to the lower index
// (numpy's stable argsort of -x). One thread per row: E and k are small.
extern "C" __global__ void tg_topk(int* ids, const float* x, int rows, int E, int k) {
    TG_GRID_LOOP(r, rows) {
        const float* xr = x + (long long)r * E;
        int* out = ids + (long long)r * k;
        for (int j = 0; j < k; ++j) {
            int best = -1;
            float bv = 0.0f;
            for (int e = 0; e < E; ++e) {
                bool taken = false;
                for (int i = 0; i < j; ++i) taken |= out[i] == e;
                if (!taken && (best < 0 || xr[e] > bv)) {
                    best = e;
                    bv = xr[e];
                }
            }
            out[j] = best;
        }
    }
}

// out[r, j] = x[r, ids[r, j]]
extern "C" __global__ void tg_take_along(float* out, const float* x, const int* ids, int n,
                                         int E, int k) {
    TG_GRID_LOOP(i, n) out[i] = x[(long long)(i / k) * E + ids[i]];
}

// out[r, e] = sum over j with ids[r, j] == e of g[r, j], in j order (take_along's backward).
extern "C" __global__ void tg_put_along(float* out, const float* g, const int* ids, int n,
                                        int E, int k) {
    TG_GRID_LOOP(i, n) {
        int r = i / E, e = i - r * E;
        float acc = 0.0f;
        for (int j = 0; j < k; ++j)
            if (ids[r * k + j] == e) acc = __fadd_rn(acc, g[r * k + j]);
        out[i] = acc;
    }
}

// routes = off[E + 1] | perm[R] of the slot ids ids[0..R). One block per expert e: its
// offset is the count of slots with a smaller expert, and its slots are written in slot
// order by a block-wide exclusive scan over chunks of blockDim.x slots.
extern "C" __global__ void tg_group_by_expert(int* routes, const int* ids, int R, int E) {
    __shared__ int sh[TG_THREADS];
    int t = threadIdx.x;
    for (int e = blockIdx.x; e < E; e += gridDim.x) {
        int before = 0;
        for (int r = t; r < R; r += blockDim.x) before += ids[r] < e;
        int off = tg_block_sum(before, sh);
        int* perm = routes + E + 1;
        int base = off;
        for (int r0 = 0; r0 < R; r0 += blockDim.x) {
            int r = r0 + t;
            int mine = (r < R && ids[r] == e) ? 1 : 0;
            sh[t] = mine;
            __syncthreads();
            for (int s = 1; s < (int)blockDim.x; s <<= 1) {  // inclusive Hillis-Steele scan
                int v = t >= s ? sh[t - s] : 0;
                __syncthreads();
                sh[t] += v;
                __syncthreads();
            }
            if (mine) perm[base + sh[t] - 1] = r;
            base += sh[blockDim.x - 1];
            __syncthreads();
        }
        if (t == 0) {
            routes[e + 1] = base;
            if (e == 0) routes[0] = 0;
        }
    }
}

// An expert's weight W[e] [rows, cols], read as f32 or through a block format F.
struct TgExpertF32 {
    const float* w;
    int cols;
    __device__ __forceinline__ float at(long long r, int c) const { return w[r * cols + c]; }
};

template <class F>
struct TgExpertBlocks {
    const unsigned char* w;
    int row_bytes;
    __device__ __forceinline__ float at(long long r, int c) const {
        return tg_dequant_at<F>(w + r * row_bytes, c);
    }
};

// out[slot, 0..N) = x[row(slot)] @ W[e]^T (NT: W[e] [N, K]) or x[row(slot)] @ W[e]
// (NN: W[e] [K, N]) for the slots of expert e = blockIdx.z; row(slot) = slot / k when x
// holds one row per token (x_by_token), else slot. tg_matmul's 64x64 tiles and fmaf
// order, so each output equals tg_matmul's on the gathered rows bit for bit.
template <class L, bool NT>
__device__ __forceinline__ void tg_expert_mm(float* out, const float* x, L w, const int* routes,
                                             int N, int K, int E, int k, int x_by_token) {
    int e = blockIdx.z;
    int lo = routes[e], M = routes[e + 1] - lo;
    int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    if (m0 >= M) return;  // the whole block leaves together: fewer slots than tiles
    const int* perm = routes + E + 1 + lo;
    int t = threadIdx.x, tx = t % 16, ty = t / 16;
    float acc[4][4];
    tg_mm_tile_loop<false, NT>(   // NT: B(k, n) = W[e][n][k], walked along W's rows
        acc, K,
        [&](int am, int gk) {
            int gm = m0 + am;
            if (gm >= M || gk >= K) return 0.0f;
            int slot = perm[gm];
            return x[(long long)(x_by_token ? slot / k : slot) * K + gk];
        },
        [&](int gk, int bn) {
            int gn = n0 + bn;
            if (gn >= N || gk >= K) return 0.0f;
            return NT ? w.at(gn, gk) : w.at(gk, gn);
        });
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int gm = m0 + ty + 16 * i;
        if (gm >= M) continue;
        long long row = (long long)perm[gm] * N;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int gn = n0 + tx + 16 * j;
            if (gn < N) out[row + gn] = acc[i][j];
        }
    }
}

#define TG_EMM_ARGS float* out, const float* x, const void* w, const int* routes, int N, int K, \
                    int E, int k, int x_by_token, int expert_stride, int row_arg
// expert_stride: elements (f32) or bytes (block formats) from one expert's weight to the
// next; row_arg: the f32 weight's row length, or a block-format row's bytes.

extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_expert_mm_nt(TG_EMM_ARGS) {
    TgExpertF32 l{(const float*)w + (long long)blockIdx.z * expert_stride, row_arg};
    tg_expert_mm<TgExpertF32, true>(out, x, l, routes, N, K, E, k, x_by_token);
}

extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_expert_mm_nn(TG_EMM_ARGS) {
    TgExpertF32 l{(const float*)w + (long long)blockIdx.z * expert_stride, row_arg};
    tg_expert_mm<TgExpertF32, false>(out, x, l, routes, N, K, E, k, x_by_token);
}

template <class F, bool NT>
__device__ __forceinline__ void tg_expert_qmm(TG_EMM_ARGS) {
    TgExpertBlocks<F> l{(const unsigned char*)w + (long long)blockIdx.z * expert_stride, row_arg};
    tg_expert_mm<TgExpertBlocks<F>, NT>(out, x, l, routes, N, K, E, k, x_by_token);
}

#define TG_EMM_PASS out, x, w, routes, N, K, E, k, x_by_token, expert_stride, row_arg
// tg_expert_mm_nt_<fmt> and tg_expert_mm_nn_<fmt>, one each per block format of
// TG_BLOCK_FORMATS (blocks.c_defines).
#define TG_EMM_KERNELS(fmt, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_expert_mm_nt_##fmt(TG_EMM_ARGS) { \
        tg_expert_qmm<Tg##NAME, true>(TG_EMM_PASS);                                       \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) tg_expert_mm_nn_##fmt(TG_EMM_ARGS) { \
        tg_expert_qmm<Tg##NAME, false>(TG_EMM_PASS);                                      \
    }
TG_BLOCK_FORMATS(TG_EMM_KERNELS)


// dW[e] [M, N] = sum over expert e's slots s, in slot order, of a[row_a(s), m] * b[row_b(s), n]
// (row_x(s) = s / k when that operand has one row per token, else s): expert_matmul's
// weight gradient, dy^T x (y = x W^T) or x^T dy (y = x W). Experts with no slots get 0.
extern "C" __global__ void __launch_bounds__(MM_THREADS)
tg_expert_mm_dw(float* out, const float* a, int a_by_token, const float* b, int b_by_token,
                const int* routes, int M, int N, int E, int k) {
    int e = blockIdx.z;
    int lo = routes[e], K = routes[e + 1] - lo;
    const int* perm = routes + E + 1 + lo;
    int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    int t = threadIdx.x, tx = t % 16, ty = t / 16;
    float acc[4][4];
    tg_mm_tile_loop<true, false>(   // A(m, k) = a[row_a(s_k)][m]: m fastest, a's rows
        acc, K,
        [&](int am, int gk) {
            int gm = m0 + am;
            if (gm >= M || gk >= K) return 0.0f;
            int s = perm[gk];
            return a[(long long)(a_by_token ? s / k : s) * M + gm];
        },
        [&](int gk, int bn) {
            int gn = n0 + bn;
            if (gn >= N || gk >= K) return 0.0f;
            int s = perm[gk];
            return b[(long long)(b_by_token ? s / k : s) * N + gn];
        });
    tg_mm_store(out + (long long)e * M * N, acc, m0, n0, M, N, tx, ty);
}
