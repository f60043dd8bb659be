// The preference family's replay kernels (replay.h): token_logprobs(+back) over logits
// [N, V] and labels [N] (-1: ignored), with the loss family's ce_max and ce_sum_exp (its
// cpu.h comes before this one in engine.py's folder order); softplus(+back) and
// log1mexp(+back) elementwise, with libm's expf, log1pf, expm1f and logf: these run on a
// value per sequence, where vector code would gain nothing.

// Whether every label is ignored (-1 and below) or a column of the V.
static inline bool pref_labels_fit(const int32_t* labels, int64_t N, int64_t V) {
    for (int64_t r = 0; r < N; r++)
        if (labels[r] >= V) return false;
    return true;
}

// log softmax(z)[label] per row, 0 where the label is ignored: numpy's (z - top) - log(sum
// of exp(z - top)). p: out [N], logits, labels (i32); i: N, V.
TG_REPLAY_KERNEL(token_logprobs) {
    float* out = (float*)n.p[0];
    const float* logits = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[2];
    const int64_t N = n.i[0], V = n.i[1];
    if (!pref_labels_fit(labels, N, V)) return 1;
    pool_for(N, [&](int64_t r, int) {
        if (labels[r] < 0) {
            out[r] = 0.0f;
            return;
        }
        const float* z = logits + r * V;
        const float top = ce_max(z, V);
        out[r] = (z[labels[r]] - top) - logf(ce_sum_exp(z, V, top, nullptr));
    });
    return 0;
}

// (onehot(label) - softmax(z)) g[r], numpy's steps: -exp((z - top) - log(sum)), 1 added
// at the label, times (valid g[r]) (so an ignored row is zeros).
// p: out [N, V], logits, labels, g [N]; i: N, V.
TG_REPLAY_KERNEL(token_logprobs_back) {
    float* out = (float*)n.p[0];
    const float* logits = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[2];
    const float* g = (const float*)n.p[3];
    const int64_t N = n.i[0], V = n.i[1];
    if (!pref_labels_fit(labels, N, V)) return 1;
    pool_for(N, [&](int64_t r, int) {
        const float* z = logits + r * V;
        float* o = out + r * V;
        const float top = ce_max(z, V);
        const float ls = logf(ce_sum_exp(z, V, top, nullptr));
        vf_apply(o, z, V, [top, ls](vf x) { return -vf_exp((x - top) - ls); });
        const bool valid = labels[r] >= 0;
        if (valid) o[labels[r]] += 1.0f;
        const float w = (valid ? 1.0f : 0.0f) * g[r];
        vf_apply(o, o, V, [w](vf x) { return x * w; });
    });
    return 0;
}

// log1p(exp(-|x|)) + max(x, 0) (a nan stays nan, as numpy's maximum).
// p: out, x; i: n.
TG_REPLAY_KERNEL(softplus) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++)
            out[i] = log1pf(expf(-fabsf(x[i]))) + (x[i] < 0.0f ? 0.0f : x[i]);
    });
    return 0;
}

// g sigmoid(x), from e = exp(-|x|): (x >= 0 ? 1 : e) / (1 + e), times g.
// p: out, x, g; i: n.
TG_REPLAY_KERNEL(softplus_back) {
    float* out = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *g = (const float*)n.p[2];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const float e = expf(-fabsf(x[i]));
            out[i] = (x[i] >= 0.0f ? 1.0f : e) / (1.0f + e) * g[i];
        }
    });
    return 0;
}

// log(1 - exp(x)): log(-expm1(x)) above -ln 2 (compared in f64, as numpy compares with
// its f64 scalar), log1p(-exp(x)) below; -inf at 0 and nan above, as numpy's.
// p: out, x; i: n.
TG_REPLAY_KERNEL(log1mexp) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    const double minus_ln2 = -0.69314718055994530942;
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++)
            out[i] = (double)x[i] > minus_ln2 ? logf(-expm1f(x[i])) : log1pf(-expf(x[i]));
    });
    return 0;
}

// -g / expm1(-x). p: out, x, g; i: n.
TG_REPLAY_KERNEL(log1mexp_back) {
    float* out = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *g = (const float*)n.p[2];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) out[i] = -g[i] / expm1f(-x[i]);
    });
    return 0;
}
