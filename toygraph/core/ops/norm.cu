// The row-wise normalisations over the last axis (ops/norm.py), rms_norm and softmax: one
// block (TG_THREADS threads) per row, each row's reductions a fixed-order tree, so results
// are bit-identical run to run.

// 1 / sqrt(mean(x^2) + eps) of one row, the same rounding in the forward and the backward.
__device__ __forceinline__ float tg_rms_inv(const float* xr, int D, float eps, float* sh) {
    float acc = 0.0f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(xr[j], xr[j]));
    float ms = __fdiv_rn(tg_block_sum(acc, sh), (float)D);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
}

extern "C" __global__ void tg_rms_norm(float* out, const float* x, int rows, int D, float eps) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + (long long)row * D;
        float* orow = out + (long long)row * D;
        float r = tg_rms_inv(xr, D, eps, sh);
        for (int j = threadIdx.x; j < D; j += blockDim.x) orow[j] = __fmul_rn(xr[j], r);
    }
}

// r * (g - y * mean(g * y)) with y = x * r, plus add[i] when add is not null (autodiff
// folds the residual stream's other gradient contribution in here: one pass, no add kernel).
extern "C" __global__ void tg_rms_norm_back(float* out, const float* x, const float* g,
                                            const float* add, int rows, int D, float eps) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + (long long)row * D;
        const float* gr = g + (long long)row * D;
        float* orow = out + (long long)row * D;
        float r = tg_rms_inv(xr, D, eps, sh);
        float gy = 0.0f;
        for (int j = threadIdx.x; j < D; j += blockDim.x)
            gy = __fadd_rn(gy, __fmul_rn(gr[j], __fmul_rn(xr[j], r)));
        float mgy = __fdiv_rn(tg_block_sum(gy, sh), (float)D);
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            float y = __fmul_rn(xr[j], r);
            float v = __fmul_rn(r, __fsub_rn(gr[j], __fmul_rn(y, mgy)));
            orow[j] = add ? __fadd_rn(v, add[(long long)row * D + j]) : v;
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

// 1 / sqrt(sum(x^2)) of each row of length D (DoRA's detached weight norm, ops/norm.py).
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
