// The preference-loss ops (ops/preference/): per-token log-probs of the labels with
// their backward, softplus and log1mexp with theirs. Numerically stable forms, as the
// numpy kernels.

// out[row] = logit[label] - max - log(sum exp(logit - max)), 0 for an ignored row (-1).
// One block per row.
extern "C" __global__ void tg_token_logprobs(float* out, const float* logits, const int* labels,
                                             int N, int V) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        int lab = labels[row];
        if (lab < 0) {  // uniform across the block: every thread skips the row
            if (threadIdx.x == 0) out[row] = 0.0f;
            continue;
        }
        const float* l = logits + (long long)row * V;
        float mx = tg_row_max(l, V, sh);
        float total = tg_row_exp_sum(l, mx, V, sh, nullptr);
        if (threadIdx.x == 0) out[row] = __fsub_rn(__fsub_rn(l[lab], mx), logf(total));
    }
}

// d/dlogits = g[row] * (onehot(label) - softmax(logits[row])), 0 on ignored rows. One
// block per row.
extern "C" __global__ void tg_token_logprobs_back(float* out, const float* logits,
                                                  const int* labels, const float* g, int N,
                                                  int V) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const float* l = logits + (long long)row * V;
        float* o = out + (long long)row * V;
        int lab = labels[row];
        float w = lab >= 0 ? g[row] : 0.0f;
        float total = tg_row_exp_sum(l, tg_row_max(l, V, sh), V, sh, o);
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float q = -__fdiv_rn(o[j], total);
            if (j == lab) q = __fadd_rn(q, 1.0f);
            o[j] = __fmul_rn(q, w);
        }
    }
}

// softplus(x) = max(x, 0) + log1p(exp(-|x|)): never overflows.
extern "C" __global__ void tg_softplus(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = __fadd_rn(log1pf(expf(-fabsf(x[i]))), fmaxf(x[i], 0.0f));
}

extern "C" __global__ void tg_softplus_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) out[i] = __fmul_rn(tg_sigmoid(x[i]), g[i]);
}

// log(1 - exp(x)): log(-expm1(x)) above -ln 2, log1p(-exp(x)) below (both accurate there).
extern "C" __global__ void tg_log1mexp(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) {
        float v = x[i];
        out[i] = v > -0.6931471805599453f ? logf(-expm1f(v)) : log1pf(-expf(v));
    }
}

extern "C" __global__ void tg_log1mexp_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) out[i] = __fdiv_rn(-g[i], expm1f(-x[i]));
}
