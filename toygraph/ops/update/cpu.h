// The update family's replay kernels (replay.h): accumulate, global_norm, adamw.

// acc += value over n elements. p: acc, value; i: n.
TG_REPLAY_KERNEL(accumulate) {
    float* acc = (float*)n.p[0];
    const float* v = (const float*)n.p[1];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) acc[i] += v[i];
    });
    return 0;
}

// sqrt(sum of every gradient's squares, in f64) / max(divisor, 1) into out (one f32).
// p: out, the gradients' addresses, their sizes (int64), divisor; i: count.
// Each tensor's squares are summed in f64 in fixed runs of 4096 elements; the runs' sums
// are added in order, then the tensors' in order, so no thread count changes the result.
TG_REPLAY_KERNEL(global_norm) {
    float* out = (float*)n.p[0];
    const float* const* grads = (const float* const*)n.p[1];
    const int64_t* sizes = (const int64_t*)n.p[2];
    const float divisor = *(const float*)n.p[3];
    const int64_t count = n.i[0], run = 4096;
    std::vector<int64_t> first(count + 1, 0);   // each tensor's first run
    for (int64_t t = 0; t < count; t++) first[t + 1] = first[t] + (sizes[t] + run - 1) / run;
    std::vector<double> sums(first[count], 0.0);
    pool_for(first[count], [&](int64_t r, int) {
        int64_t t = 0;
        while (first[t + 1] <= r) t++;
        const float* g = grads[t];
        const int64_t i0 = (r - first[t]) * run, i1 = i0 + run < sizes[t] ? i0 + run : sizes[t];
        double s = 0.0;
        for (int64_t i = i0; i < i1; i++) s += (double)g[i] * (double)g[i];
        sums[r] = s;
    });
    double sq = 0.0;
    for (double s : sums) sq += s;
    *out = (float)(sqrt(sq) / (divisor > 1.0f ? (double)divisor : 1.0));
    return 0;
}

// AdamW over every parameter (numpy's _adamw_one, operation for operation in f32).
// p: params, grads, m, v (addresses), sizes (int64), lr scales (f64), hp row (9 f32),
// norm (f32), divisor (f32); i: count; f: max_norm.
TG_REPLAY_KERNEL(adamw) {
    float* const* ws = (float* const*)n.p[0];
    const float* const* gs = (const float* const*)n.p[1];
    float* const* ms = (float* const*)n.p[2];
    float* const* vs = (float* const*)n.p[3];
    const int64_t* sizes = (const int64_t*)n.p[4];
    const double* lr_scales = (const double*)n.p[5];
    const float* hp = (const float*)n.p[6];
    const double norm = *(const float*)n.p[7], divisor = *(const float*)n.p[8];
    const int64_t count = n.i[0];
    const double max_norm = n.f[0];
    double coef = 1.0 / (divisor > 1.0 ? divisor : 1.0);
    if (max_norm > 0 && norm > max_norm) coef *= max_norm / norm;
    const float c = (float)coef, b1 = hp[1], b2 = hp[2], eps = hp[3], wd = hp[4];
    const float b1h = hp[5], b2h = hp[6];
    const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
    for (int64_t t = 0; t < count; t++) {
        const float lr = hp[0] * (float)lr_scales[t], decay = 1.0f - lr * wd;
        float *w = ws[t], *m = ms[t], *v = vs[t];
        const float* g = gs[t];
        replay_for(sizes[t], 1, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; i++) {
                const float gi = g[i] * c;
                m[i] = m[i] * b1 + one_b1 * gi;
                v[i] = v[i] * b2 + one_b2 * gi * gi;
                w[i] = w[i] * decay;
                w[i] = w[i] - lr * (m[i] * b1h) / (sqrtf(v[i] * b2h) + eps);
            }
        });
    }
    return 0;
}
