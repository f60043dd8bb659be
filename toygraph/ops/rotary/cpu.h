// The rotary family's replay kernel (replay.h): rope on x [B, T, H, hd] at positions [B, T],
// the first ``dims`` features of each head turned in pairs, the rest copied.
//
// The angles are numpy's (rotary/numpy.py rope_angles): theta = pos * base^(-2i/dims)
// / factors[i] * freq_scale in f64, cos and sin rounded to f32. One table of them serves
// every rope node at the same positions (a step's q and k of every layer): the last
// table is kept with the positions and settings it was made for.
#include <math.h>

struct RopeAngles {
    std::vector<int32_t> pos;
    std::vector<float> factors;
    int64_t half = 0;
    double base = 0, freq_scale = 0;
    std::vector<float> cos, sin;   // [positions][half]
};

static const RopeAngles& rope_angles(const int32_t* pos, int64_t npos, int64_t dims, double base,
                                     const float* factors, double freq_scale) {
    static RopeAngles kept;
    const int64_t half = dims / 2;
    const bool same = kept.half == half && kept.base == base && kept.freq_scale == freq_scale
        && (int64_t)kept.pos.size() == npos && memcmp(kept.pos.data(), pos, npos * 4) == 0
        && kept.factors.size() == (factors ? (size_t)half : 0)
        && (!factors || memcmp(kept.factors.data(), factors, half * 4) == 0);
    if (same) return kept;
    kept.pos.assign(pos, pos + npos);
    if (factors) kept.factors.assign(factors, factors + half);
    else kept.factors.clear();
    kept.half = half;
    kept.base = base;
    kept.freq_scale = freq_scale;
    kept.cos.resize(npos * half);
    kept.sin.resize(npos * half);
    std::vector<double> inv(half);
    for (int64_t i = 0; i < half; i++) {
        inv[i] = pow(base, -(double)(2 * i) / (double)dims);
        if (factors) inv[i] = inv[i] / (double)factors[i];
    }
    for (int64_t t = 0; t < npos; t++)
        for (int64_t i = 0; i < half; i++) {
            double theta = (double)pos[t] * inv[i];
            theta *= freq_scale;
            kept.cos[t * half + i] = (float)cos(theta);
            kept.sin[t * half + i] = (float)sin(theta);
        }
    return kept;
}

// p: out, x, positions (i32), factors or null; i: positions (B T), heads, hd, dims,
// neox (0/1), inverse (0/1); f: base, freq_scale.
TG_REPLAY_KERNEL(rope) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    const int64_t npos = n.i[0], heads = n.i[1], hd = n.i[2], dims = n.i[3], half = dims / 2;
    const bool neox = n.i[4] != 0;
    const float sign = n.i[5] ? -1.0f : 1.0f;
    const RopeAngles& a = rope_angles((const int32_t*)n.p[2], npos, dims, n.f[0],
                                      (const float*)n.p[3], n.f[1]);
    const int64_t step = neox ? 1 : 2, other = neox ? half : 1;
    replay_for(npos * heads, hd, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const float *c = a.cos.data() + (r / heads) * half, *s = a.sin.data() + (r / heads) * half;
            const float* xr = x + r * hd;
            float* o = out + r * hd;
            for (int64_t i = 0; i < half; i++) {
                const float x0 = xr[i * step], x1 = xr[i * step + other], si = sign * s[i];
                o[i * step] = x0 * c[i] - x1 * si;
                o[i * step + other] = x0 * si + x1 * c[i];
            }
            for (int64_t j = dims; j < hd; j++) o[j] = xr[j];
        }
    });
    return 0;
}
