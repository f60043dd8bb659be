// Vector exp and tanh for the replay kernels, written with GCC's vector extensions so one
// source compiles to AVX-512, AVX2, NEON or plain scalar code (the width is simd.h's VL,
// at least 4). libm's expf and tanhf are one element at a time; these are ~10x faster.
//
// Both are Cephes' single-precision algorithms (exp: a degree-6 polynomial on
// x - n ln 2 split in two parts, times 2^n; tanh: a polynomial near 0, else
// 1 - 2 / (exp(2|x|) + 1)): about 1 to 2 units in the last place from the true value,
// where numpy's are about 1. exp runs into the subnormals down to -103.97 and is 0 below
// (a masked score of -inf gives exactly 0), inf above 88.72, as numpy's.

static const int VW = VL >= 4 ? VL : 4;
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf vf_load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vf_store(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_set(float x) { return vf{} + x; }

static inline vf vf_floor(vf y) {
    const vf t = __builtin_convertvector(__builtin_convertvector(y, vi), vf);
    return t > y ? t - 1.0f : t;   // truncation rounds toward zero; floor goes down
}

static inline vf vf_exp(vf x) {
    // Past these ends the f32 result is 0 (below ln 2^-150: under half the least subnormal)
    // or inf (above ln of the largest float).
    const float lo = -103.97207708f, hi = 88.72283935546875f;
    const vi zero = x < lo, over = x > hi;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const vf n = vf_floor(x * 1.44269504088896341f + 0.5f);
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vf_set(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    // 2^n in two factors, each a normal float for n in [-150, 128], so exp(88.5) is not
    // inf and a result below 2^-126 is rounded once into the subnormals.
    const vi e = __builtin_convertvector(n, vi), e1 = e >> 1, e2 = e - e1;
    vf y = p * (vf)((e1 + 127) << 23) * (vf)((e2 + 127) << 23);
    y = zero ? vf{} : y;
    return over ? vf_set(INFINITY) : y;
}

static inline vf vf_tanh(vf x) {
    const vf ax = x < 0.0f ? -x : x;
    const vf z = x * x;
    vf p = vf_set(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const vf small = p * z * x + x;
    const vf e = vf_exp(ax + ax);
    vf large = 1.0f - 2.0f / (e + 1.0f);
    large = x < 0.0f ? -large : large;
    return ax < 0.625f ? small : large;
}

// f(vector) over n floats: whole vectors in place, the tail through a padded copy.
template <class F>
static inline void vf_apply(float* out, const float* in, int64_t n, F&& f) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(out + i, f(vf_load(in + i)));
    if (i < n) {
        float buf[VW] = {0};
        memcpy(buf, in + i, (size_t)(n - i) * 4);
        vf_store(buf, f(vf_load(buf)));
        memcpy(out + i, buf, (size_t)(n - i) * 4);
    }
}
