// The norm family's replay kernels (replay.h): rms_norm, rms_norm_back, softmax,
// softmax_back and inv_row_norm over rows of width d. Each row's sums run in column order
// (softmax's sum of exps as the loss family's ce_sum_exp: its cpu.h comes before this one
// in engine.py's folder order); rows are split over the pool.

// 1 / sqrt(mean(x^2) + eps) of one row: the squares (each rounded to f32, as numpy's
// x * x) summed in f64 and rounded once, then numpy's f32 steps.
static inline float rms_inv(const float* x, int64_t d, float eps) {
    double s = 0.0;
    for (int64_t j = 0; j < d; j++) s += (double)(x[j] * x[j]);
    return 1.0f / sqrtf((float)s / (float)d + eps);
}

// out = x r (times w when given: a [d] weight, w_step 0, or one of x's shape, w_step d).
// p: out, x, w or null; i: rows, d, w_step; f: eps.
TG_REPLAY_KERNEL(rms_norm) {
    float* out = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *w = (const float*)n.p[2];
    const int64_t d = n.i[1], w_step = n.i[2];
    const float eps = (float)n.f[0];
    replay_for(n.i[0], d, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const float* xr = x + r * d;
            float* o = out + r * d;
            const float inv = rms_inv(xr, d, eps);
            for (int64_t j = 0; j < d; j++) o[j] = xr[j] * inv;
            if (w)
                for (int64_t j = 0; j < d; j++) o[j] = o[j] * w[r * w_step + j];
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

// softmax(scale x) of a row of d, causal: only its first ``valid`` columns, the rest 0
// (numpy's -inf scores, whose exp is exactly 0). numpy's steps: z = x s rounded, minus the
// row's max, exp, divided by the sum of the exps.
static inline void norm_softmax_row(float* o, const float* x, int64_t d, int64_t valid, float scale) {
    for (int64_t j = 0; j < valid; j++) o[j] = x[j] * scale;
    const float top = ce_max(o, valid);
    const float sum = ce_sum_exp(o, valid, top, o);
    vf_apply(o, o, valid, [sum](vf e) { return e / sum; });
    for (int64_t j = valid; j < d; j++) o[j] = 0.0f;
}

// p: out, x; i: rows, d, causal (row r of a [.., d, d] block keeps keys j <= r % d); f: scale.
TG_REPLAY_KERNEL(softmax) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    const int64_t d = n.i[1];
    const bool causal = n.i[2] != 0;
    const float scale = (float)n.f[0];
    replay_for(n.i[0], d, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++)
            norm_softmax_row(out + r * d, x + r * d, d, causal ? r % d + 1 : d, scale);
    });
    return 0;
}

// out = (scale y) (g - sum(g y)): the products rounded to f32 (numpy's g * y), summed in
// f64 and rounded once. p: out, y, g; i: rows, d; f: scale.
TG_REPLAY_KERNEL(softmax_back) {
    float* out = (float*)n.p[0];
    const float *y = (const float*)n.p[1], *g = (const float*)n.p[2];
    const int64_t d = n.i[1];
    const float scale = (float)n.f[0];
    replay_for(n.i[0], d, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const float *yr = y + r * d, *gr = g + r * d;
            float* o = out + r * d;
            double s = 0.0;
            for (int64_t j = 0; j < d; j++) s += (double)(gr[j] * yr[j]);
            const float dot = (float)s;
            for (int64_t j = 0; j < d; j++) o[j] = scale * yr[j] * (gr[j] - dot);
        }
    });
    return 0;
}

// out[r] = 1 / sqrt(sum of row r's squares), the squares rounded to f32 and summed in f64.
// p: out [rows], x; i: rows, d.
TG_REPLAY_KERNEL(inv_row_norm) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    const int64_t d = n.i[1];
    replay_for(n.i[0], d, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const float* xr = x + r * d;
            double s = 0.0;
            for (int64_t j = 0; j < d; j++) s += (double)(xr[j] * xr[j]);
            out[r] = 1.0f / sqrtf((float)s);
        }
    });
    return 0;
}
