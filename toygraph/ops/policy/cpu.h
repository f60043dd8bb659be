// The policy family's replay kernels (replay.h): clipped_surrogate(+back) and
// kl_penalty(+back), elementwise over per-token log-probs with libm's expf and expm1f (a
// value per token: vector code would gain nothing), numpy's operations in its order.

// -min(r adv, clip(r, lo, hi) adv), r = exp(logp - old).
// p: out, logp, old, adv; i: n; f: lo, hi.
TG_REPLAY_KERNEL(clipped_surrogate) {
    float* out = (float*)n.p[0];
    const float *logp = (const float*)n.p[1], *old = (const float*)n.p[2];
    const float* adv = (const float*)n.p[3];
    const float lo = (float)n.f[0], hi = (float)n.f[1];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const float r = expf(logp[i] - old[i]);
            const float c = r < lo ? lo : (r > hi ? hi : r);
            const float a = r * adv[i], b = c * adv[i];
            out[i] = -(b < a ? b : a);   // a nan r (or adv) makes a nan: kept, as numpy's minimum
        }
    });
    return 0;
}

// 0 where the clipped term is the minimum (r > hi with adv > 0, r < lo with adv < 0),
// else -(r adv) g. p: out, logp, old, adv, g; i: n; f: lo, hi.
TG_REPLAY_KERNEL(clipped_surrogate_back) {
    float* out = (float*)n.p[0];
    const float *logp = (const float*)n.p[1], *old = (const float*)n.p[2];
    const float *adv = (const float*)n.p[3], *g = (const float*)n.p[4];
    const float lo = (float)n.f[0], hi = (float)n.f[1];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const float r = expf(logp[i] - old[i]);
            const bool clipped = (r > hi && adv[i] > 0.0f) || (r < lo && adv[i] < 0.0f);
            out[i] = clipped ? 0.0f : -(r * adv[i]) * g[i];
        }
    });
    return 0;
}

// expm1(d) - d, d = ref - logp. p: out, logp, ref; i: n.
TG_REPLAY_KERNEL(kl_penalty) {
    float* out = (float*)n.p[0];
    const float *logp = (const float*)n.p[1], *ref = (const float*)n.p[2];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const float d = ref[i] - logp[i];
            out[i] = expm1f(d) - d;
        }
    });
    return 0;
}

// -expm1(ref - logp) g. p: out, logp, ref, g; i: n.
TG_REPLAY_KERNEL(kl_penalty_back) {
    float* out = (float*)n.p[0];
    const float *logp = (const float*)n.p[1], *ref = (const float*)n.p[2];
    const float* g = (const float*)n.p[3];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) out[i] = -expm1f(ref[i] - logp[i]) * g[i];
    });
    return 0;
}
