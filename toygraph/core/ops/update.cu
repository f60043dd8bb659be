// Training side effects: gradient norm (deterministic two-pass reduction in double) and
// the AdamW update with in-graph clipping, in numpy's f32 rounding order.

// Pass 1: block b writes the sum of squares of its grid-stride share of g.
extern "C" __global__ void tg_sumsq_partial(double* partials, const float* g, int n) {
    __shared__ double sh[TG_THREADS];
    double acc = 0.0;
    TG_GRID_LOOP(i, n) {
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
// scaled by min(1, max_norm / norm) when max_norm > 0.
extern "C" __global__ void tg_adamw(float* w, const float* g, float* m, float* v, const float* hp,
                                    const float* norm, const float* divisor, int n,
                                    double max_norm, float lr_scale) {
    // lr_scale: this tensor's learning-rate multiplier (LoRA+), 1 for most.
    float lr = __fmul_rn(hp[0], lr_scale), b1 = hp[1], b2 = hp[2], eps = hp[3], wd = hp[4], b1h = hp[5], b2h = hp[6];
    double coef = 1.0 / fmax((double)divisor[0], 1.0);
    double nrm = (double)norm[0];
    if (max_norm > 0.0 && nrm > max_norm) coef *= max_norm / nrm;
    float c = (float)coef;
    float one_b1 = __fsub_rn(1.0f, b1), one_b2 = __fsub_rn(1.0f, b2);
    float decay = __fsub_rn(1.0f, __fmul_rn(lr, wd));
    TG_GRID_LOOP(i, n) {
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
