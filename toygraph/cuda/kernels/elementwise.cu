// Elementwise ops, strided copies (permute/expand), fills and accumulation.
// __f*_rn intrinsics keep numpy's rounding order (no FMA contraction).

// op: 0 add, 1 sub, 2 mul. `s` walks the output shape with a's and b's strides.
extern "C" __global__ void tg_binary(float* out, const float* a, const float* b, int n,
                                     Strided s, int op) {
    TG_GRID_LOOP(i, n) {
        int oa, ob;
        tg_offsets(s, i, oa, ob);
        float x = a[oa], y = b[ob];
        out[i] = op == 0 ? __fadd_rn(x, y) : (op == 1 ? __fsub_rn(x, y) : __fmul_rn(x, y));
    }
}

extern "C" __global__ void tg_scale(float* out, const float* x, int n, float s) {
    TG_GRID_LOOP(i, n) out[i] = __fmul_rn(x[i], s);
}

extern "C" __global__ void tg_silu(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = __fmul_rn(x[i], tg_sigmoid(x[i]));
}

// g * s * (1 + x * (1 - s)), left to right as numpy evaluates it.
extern "C" __global__ void tg_silu_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) {
        float s = tg_sigmoid(x[i]);
        float t = __fadd_rn(1.0f, __fmul_rn(x[i], __fsub_rn(1.0f, s)));
        out[i] = __fmul_rn(__fmul_rn(g[i], s), t);
    }
}

// GELU, tanh approximation: t = tanh(c (x + a x^3)), c = sqrt(2/pi), a = 0.044715, with
// the products in the numpy kernel's order ((a x) x) x.
#define TG_GELU_C 0.7978845608028654f
#define TG_GELU_A 0.044715f

__device__ __forceinline__ float tg_gelu_tanh(float x) {
    float cube = __fmul_rn(__fmul_rn(__fmul_rn(TG_GELU_A, x), x), x);
    return tanhf(__fmul_rn(TG_GELU_C, __fadd_rn(x, cube)));
}

// x * 0.5 (1 + t).
extern "C" __global__ void tg_gelu(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) {
        float t = tg_gelu_tanh(x[i]);
        out[i] = __fmul_rn(x[i], __fmul_rn(0.5f, __fadd_rn(1.0f, t)));
    }
}

// g * (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3a x^2)), left to right as numpy evaluates it.
extern "C" __global__ void tg_gelu_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) {
        float xi = x[i], t = tg_gelu_tanh(xi);
        float outer = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
        float inner = __fmul_rn(__fmul_rn(0.5f, xi), __fsub_rn(1.0f, __fmul_rn(t, t)));
        inner = __fmul_rn(inner, TG_GELU_C);
        float poly = __fadd_rn(1.0f, __fmul_rn(__fmul_rn(3.0f * TG_GELU_A, xi), xi));
        out[i] = __fmul_rn(g[i], __fadd_rn(outer, __fmul_rn(inner, poly)));
    }
}

// Bitwise copies work for f32 and i32 alike (reshape/contiguous of token ids).
extern "C" __global__ void tg_copy(unsigned int* out, const unsigned int* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = x[i];
}

// out[i] = x[offset of output index i under s.sa]: permute, expand (stride 0 for
// broadcast dims, grouped dims split into (groups, 0-stride repeat)).
extern "C" __global__ void tg_gather(unsigned int* out, const unsigned int* x, int n,
                                     Strided s) {
    TG_GRID_LOOP(i, n) out[i] = x[tg_offset_a(s, i)];
}

extern "C" __global__ void tg_fill(float* out, int n, float v) {
    TG_GRID_LOOP(i, n) out[i] = v;
}

extern "C" __global__ void tg_accumulate(float* acc, const float* v, int n) {
    TG_GRID_LOOP(i, n) acc[i] = __fadd_rn(acc[i], v[i]);
}

// Rotary embedding of x [rows = batch*seq*heads, D] at pos [batch*seq]; one thread per
// element. Pair i at position p turns by freq_scale * p * base^(-2i/dims) / factors[i]
// (factors: the [dims/2] frequency factors, or nullptr for none), in double and then cast
// to f32, exactly as the numpy kernel computes it.
extern "C" __global__ void tg_rope(float* out, const float* x, const int* pos,
                                   const float* factors, int n, int heads, int D, int dims,
                                   double base, double freq_scale, int neox, int inverse) {
    TG_GRID_LOOP(e, n) {
        int row = e / D, j = e - row * D;
        const float* xr = x + (long long)row * D;
        if (j >= dims) {
            out[e] = xr[j];
            continue;
        }
        int half = dims / 2, pair, second;
        int i0, i1;
        if (neox) {
            second = j >= half;
            pair = second ? j - half : j;
            i0 = pair;
            i1 = pair + half;
        } else {
            second = j & 1;
            pair = j >> 1;
            i0 = 2 * pair;
            i1 = i0 + 1;
        }
        double inv_freq = pow(base, -(double)(2 * pair) / (double)dims);
        if (factors) inv_freq = inv_freq / (double)factors[pair];
        double theta = (double)pos[row / heads] * inv_freq * freq_scale;
        float c = (float)cos(theta), sn = (float)sin(theta);
        if (inverse) sn = -sn;
        float x0 = xr[i0], x1 = xr[i1];
        out[e] = second ? __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c))
                        : __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
    }
}
