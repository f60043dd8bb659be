// The row-wise normalisations over the last axis (ops/norm/), rms_norm and softmax: one
// block (TG_THREADS threads) per row, each row's reductions a fixed-order tree, so results
// are bit-identical run to run.

// 1 / sqrt(mean(x^2) + eps) of the row at x[at..at+D), the same rounding in the forward and
// the backward; x may be kept in bf16 (bit 0 of `bf16`, common.cuh's tg_ldx).
__device__ __forceinline__ float tg_rms_inv(const void* x, long long at, int D, float eps,
                                            int bf16, float* sh) {
    float acc = 0.0f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        float v = tg_ldx(x, at + j, bf16, 0);
        acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
    float ms = __fdiv_rn(tg_block_sum(acc, sh), (float)D);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
}

// (x r) * w with r = tg_rms_inv: x r rounded first, then the product by the weight, as the
// unweighted norm and a mul after it round (w null: x r alone). w[row * wstride + j]:
// wstride 0 for a [D] weight, D for one of x's shape (the weight gradient's g). x, w and
// out may be kept in bf16 (bits 0, 1 and TG_OUT_BF16 of `bf16`); the arithmetic is f32.
extern "C" __global__ void tg_rms_norm(void* out, const void* x, const void* w, int wstride,
                                       int rows, int D, float eps, int bf16) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long at = (long long)row * D;
        float r = tg_rms_inv(x, at, D, eps, bf16, sh);
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            float y = __fmul_rn(tg_ldx(x, at + j, bf16, 0), r);
            if (w) y = __fmul_rn(y, tg_ldx(w, (long long)row * wstride + j, bf16, 1));
            tg_stx(out, at + j, y, bf16);
        }
    }
}

// g times the weight (when there is one), rounded before the norm's backward reads it, as
// the mul's backward rounds it in the unfused graph.
__device__ __forceinline__ float tg_rms_grad_in(const void* g, const float* w, int wstride,
                                                int row, long long at, int j, int bf16) {
    float v = tg_ldx(g, at + j, bf16, 1);
    return w ? __fmul_rn(v, w[(long long)row * wstride + j]) : v;
}

// r * (gw - y * mean(gw * y)) with y = x * r and gw = g * w (g alone when w is null), plus
// add[i] when add is not null (autodiff folds the residual stream's other gradient
// contribution in here: one pass, no add kernel). x and g may be kept in bf16 (bits 0 and 1
// of `bf16`); w, add and out are f32.
extern "C" __global__ void tg_rms_norm_back(float* out, const void* x, const void* g,
                                            const float* w, int wstride, const float* add,
                                            int rows, int D, float eps, int bf16) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long at = (long long)row * D;
        float r = tg_rms_inv(x, at, D, eps, bf16, sh);
        float gy = 0.0f;
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            float y = __fmul_rn(tg_ldx(x, at + j, bf16, 0), r);
            gy = __fadd_rn(gy, __fmul_rn(tg_rms_grad_in(g, w, wstride, row, at, j, bf16), y));
        }
        float mgy = __fdiv_rn(tg_block_sum(gy, sh), (float)D);
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            float y = __fmul_rn(tg_ldx(x, at + j, bf16, 0), r);
            float gw = tg_rms_grad_in(g, w, wstride, row, at, j, bf16);
            float v = __fmul_rn(r, __fsub_rn(gw, __fmul_rn(y, mgy)));
            out[at + j] = add ? __fadd_rn(v, add[at + j]) : v;
        }
    }
}

// softmax(scale * x) over rows of length T. With `causal`, the row's query index is
// row % T (the last two axes are [T, T]) and keys after it get probability 0.
extern "C" __global__ void tg_softmax(float* out, const float* x, int rows, int T, float scale,
                                      int causal) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + (long long)row * T;
        float* orow = out + (long long)row * T;
        int limit = causal ? (row % T) + 1 : T;  // keys j < limit are visible
        float mx = __int_as_float(0xff800000);  // -inf
        for (int j = threadIdx.x; j < limit; j += blockDim.x) mx = fmaxf(mx, __fmul_rn(xr[j], scale));
        mx = tg_block_max(mx, sh);
        float acc = 0.0f;
        for (int j = threadIdx.x; j < T; j += blockDim.x) {
            float e = j < limit ? expf(__fsub_rn(__fmul_rn(xr[j], scale), mx)) : 0.0f;
            orow[j] = e;
            acc = __fadd_rn(acc, e);
        }
        float total = tg_block_sum(acc, sh);
        for (int j = threadIdx.x; j < T; j += blockDim.x) orow[j] = __fdiv_rn(orow[j], total);
    }
}

// scale * y * (g - sum(g * y)).
extern "C" __global__ void tg_softmax_back(float* out, const float* y, const float* g, int rows,
                                           int T, float scale) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* yr = y + (long long)row * T;
        const float* gr = g + (long long)row * T;
        float* orow = out + (long long)row * T;
        float acc = 0.0f;
        for (int j = threadIdx.x; j < T; j += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(gr[j], yr[j]));
        float s = tg_block_sum(acc, sh);
        for (int j = threadIdx.x; j < T; j += blockDim.x)
            orow[j] = __fmul_rn(__fmul_rn(scale, yr[j]), __fsub_rn(gr[j], s));
    }
}

// 1 / sqrt(sum(x^2)) of each row of length D (DoRA's detached weight norm, ops/norm/).
extern "C" __global__ void tg_inv_row_norm(float* out, const float* x, int rows, int D) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + (long long)row * D;
        float acc = 0.0f;
        for (int j = threadIdx.x; j < D; j += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(xr[j], xr[j]));
        float total = tg_block_sum(acc, sh);
        if (threadIdx.x == 0) out[row] = __fdiv_rn(1.0f, __fsqrt_rn(total));
    }
}
