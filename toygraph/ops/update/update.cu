// Training side effects: gradient norm (deterministic two-pass reduction in double) and
// the AdamW update with in-graph clipping, in numpy's f32 rounding order. Both run over
// many tensors per launch (as PyTorch's multi_tensor_apply and llm.c do): a TgTensorList
// passed by value says which tensor each block works on.

// Up to TG_LIST_TENSORS tensors: up to four buffers each (AdamW: w, g, m, v; the norm: g),
// their sizes, a scale per tensor (AdamW's learning-rate multiplier), and the first block
// of each: blocks [block_start[k], block_start[k + 1]) stride over tensor k.
struct TgTensorList {
    float* buf[4][TG_LIST_TENSORS];
    int n[TG_LIST_TENSORS];
    float scale[TG_LIST_TENSORS];
    int block_start[TG_LIST_TENSORS + 1];
    int count;
};
static_assert(sizeof(TgTensorList) == 44 * TG_LIST_TENSORS + 8, "TgTensorList has padding: "
              "ops/update/ packs it without any");

// The tensor this block works on, and the block's index among that tensor's blocks.
__device__ __forceinline__ int tg_list_tensor(const TgTensorList& l, int& block, int& blocks) {
    int lo = 0, hi = l.count - 1;            // the last k with block_start[k] <= blockIdx.x
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (l.block_start[mid] <= (int)blockIdx.x) lo = mid; else hi = mid - 1;
    }
    block = (int)blockIdx.x - l.block_start[lo];
    blocks = l.block_start[lo + 1] - l.block_start[lo];
    return lo;
}

// Pass 1: block b writes partials[b], the sum of squares of its grid-stride share of its
// tensor (the share and the order of a one-tensor launch of that tensor's blocks).
extern "C" __global__ void tg_sumsq_list(double* partials, TgTensorList l) {
    __shared__ double sh[TG_THREADS];
    int block, blocks;
    int k = tg_list_tensor(l, block, blocks);
    const float* g = l.buf[0][k];
    double acc = 0.0;
    for (int i = block * blockDim.x + threadIdx.x; i < l.n[k]; i += blocks * blockDim.x) {
        double v = (double)g[i];
        acc += v * v;
    }
    double s = tg_block_sum(acc, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// Pass 2 (one block): sqrt(sum of all partials) / max(divisor, 1).
extern "C" __global__ void tg_global_norm(float* out, const double* partials, int nparts,
                                          const float* divisor) {
    __shared__ double sh[TG_THREADS];
    double acc = 0.0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partials[i];
    double s = tg_block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = (float)(sqrt(s) / fmax((double)divisor[0], 1.0));
}

// hp = [lr, b1, b2, eps, wd, 1/(1-b1^t), 1/(1-b2^t)]; g is divided by max(divisor, 1) and
// scaled by min(1, max_norm / norm) when max_norm > 0. Tensor k's buffers are w, g, m, v
// and its learning rate is lr * scale[k] (LoRA+; 1 for most).
extern "C" __global__ void tg_adamw_list(TgTensorList l, const float* hp, const float* norm,
                                         const float* divisor, double max_norm) {
    int block, blocks;
    int k = tg_list_tensor(l, block, blocks);
    float *w = l.buf[0][k], *m = l.buf[2][k], *v = l.buf[3][k];
    const float* g = l.buf[1][k];
    float lr = __fmul_rn(hp[0], l.scale[k]), b1 = hp[1], b2 = hp[2], eps = hp[3], wd = hp[4];
    float b1h = hp[5], b2h = hp[6];
    double coef = 1.0 / fmax((double)divisor[0], 1.0);
    double nrm = (double)norm[0];
    if (max_norm > 0.0 && nrm > max_norm) coef *= max_norm / nrm;
    float c = (float)coef;
    float one_b1 = __fsub_rn(1.0f, b1), one_b2 = __fsub_rn(1.0f, b2);
    float decay = __fsub_rn(1.0f, __fmul_rn(lr, wd));
    for (int i = block * blockDim.x + threadIdx.x; i < l.n[k]; i += blocks * blockDim.x) {
        float gs = __fmul_rn(g[i], c);
        float mi = __fadd_rn(__fmul_rn(m[i], b1), __fmul_rn(one_b1, gs));
        float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(one_b2, gs), gs));
        float wi = __fmul_rn(w[i], decay);
        float step = __fdiv_rn(__fmul_rn(lr, __fmul_rn(mi, b1h)),
                               __fadd_rn(__fsqrt_rn(__fmul_rn(vi, b2h)), eps));
        m[i] = mi;
        v[i] = vi;
        w[i] = __fsub_rn(wi, step);
    }
}

// Gradient accumulation across micro-batches: acc += v in place.
extern "C" __global__ void tg_accumulate(float* acc, const float* v, int n) {
    TG_GRID_LOOP(i, n) acc[i] = __fadd_rn(acc[i], v[i]);
}
