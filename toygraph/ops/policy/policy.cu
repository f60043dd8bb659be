// The policy-gradient loss ops (ops/policy/): the clipped surrogate of GRPO/PPO and the
// k3 KL estimate, each with its backward (the gradient of the first operand only). The
// same formulas as the numpy kernels.

// out = -min(r a, clip(r, lo, hi) a), r = exp(logp - old).
extern "C" __global__ void tg_clipped_surrogate(float* out, const float* logp, const float* old,
                                                const float* adv, int n, float lo, float hi) {
    TG_GRID_LOOP(i, n) {
        float r = expf(__fsub_rn(logp[i], old[i]));
        float a = adv[i];
        float c = fminf(fmaxf(r, lo), hi);
        out[i] = -fminf(__fmul_rn(r, a), __fmul_rn(c, a));
    }
}

// d out / d logp = -r a where the unclipped term is the minimum, 0 where the clipped one is.
extern "C" __global__ void tg_clipped_surrogate_back(float* out, const float* logp,
                                                     const float* old, const float* adv,
                                                     const float* g, int n, float lo, float hi) {
    TG_GRID_LOOP(i, n) {
        float r = expf(__fsub_rn(logp[i], old[i]));
        float a = adv[i];
        bool clipped = (r > hi && a > 0.0f) || (r < lo && a < 0.0f);
        out[i] = clipped ? 0.0f : -__fmul_rn(__fmul_rn(r, a), g[i]);
    }
}

// out = exp(d) - d - 1 = expm1(d) - d, d = ref - logp.
extern "C" __global__ void tg_kl_penalty(float* out, const float* logp, const float* ref, int n) {
    TG_GRID_LOOP(i, n) {
        float d = __fsub_rn(ref[i], logp[i]);
        out[i] = __fsub_rn(expm1f(d), d);
    }
}

// d out / d logp = 1 - exp(ref - logp) = -expm1(ref - logp).
extern "C" __global__ void tg_kl_penalty_back(float* out, const float* logp, const float* ref,
                                              const float* g, int n) {
    TG_GRID_LOOP(i, n) out[i] = -__fmul_rn(expm1f(__fsub_rn(ref[i], logp[i])), g[i]);
}
