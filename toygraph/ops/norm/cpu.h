// The norm family's replay kernels (replay.h): rms_norm and rms_norm_back over rows of
// width d. Each row's sums run in column order; rows are split over the pool.

// 1 / sqrt(mean(x^2) + eps) of one row: the squares (each rounded to f32, as numpy's
// x * x) summed in f64 and rounded once, then numpy's f32 steps.
static inline float rms_inv(const float* x, int64_t d, float eps) {
    double s = 0.0;
    for (int64_t j = 0; j < d; j++) s += (double)(x[j] * x[j]);
    return 1.0f / sqrtf((float)s / (float)d + eps);
}

// out = x r (times w when given). p: out, x, w or null; i: rows, d; f: eps.
TG_REPLAY_KERNEL(rms_norm) {
    float* out = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *w = (const float*)n.p[2];
    const int64_t d = n.i[1];
    const float eps = (float)n.f[0];
    replay_for(n.i[0], d, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const float* xr = x + r * d;
            float* o = out + r * d;
            const float inv = rms_inv(xr, d, eps);
            for (int64_t j = 0; j < d; j++) o[j] = xr[j] * inv;
            if (w)
                for (int64_t j = 0; j < d; j++) o[j] = o[j] * w[j];
        }
    });
    return 0;
}

// out = r (g' - y mean(g' y)) (+ add), y = x r, g' = g w when weighted.
// p: out, x, g, w or null, add or null; i: rows, d; f: eps.
TG_REPLAY_KERNEL(rms_norm_back) {
    float* out = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *g = (const float*)n.p[2];
    const float *w = (const float*)n.p[3], *add = (const float*)n.p[4];
    const int64_t d = n.i[1];
    const float eps = (float)n.f[0];
    replay_for(n.i[0], d, [&](int64_t r0, int64_t r1) {
        float* gw = replay_scratch((size_t)d);
        for (int64_t r = r0; r < r1; r++) {
            const float *xr = x + r * d, *gr = g + r * d;
            float* o = out + r * d;
            if (w) {
                for (int64_t j = 0; j < d; j++) gw[j] = gr[j] * w[j];
                gr = gw;
            }
            const float inv = rms_inv(xr, d, eps);
            double s = 0.0;
            for (int64_t j = 0; j < d; j++) s += (double)(gr[j] * (xr[j] * inv));
            const float mean = (float)s / (float)d;
            for (int64_t j = 0; j < d; j++) o[j] = inv * (gr[j] - (xr[j] * inv) * mean);
            if (add)
                for (int64_t j = 0; j < d; j++) o[j] = o[j] + add[r * d + j];
        }
    });
    return 0;
}
