// Elementwise ops (ops/elementwise/): add/sub/mul with broadcasting, scale, and the
// activations silu, gelu and gpt-oss's clamped SwiGLU with their backward kernels.
// __f*_rn intrinsics keep numpy's rounding order (no FMA contraction).

__device__ __forceinline__ float tg_binary_op(float x, float y, int op) {
    return op == 0 ? __fadd_rn(x, y) : (op == 1 ? __fsub_rn(x, y) : __fmul_rn(x, y));
}

// op: 0 add, 1 sub, 2 mul. `s` walks the output shape with a's and b's strides.
extern "C" __global__ void tg_binary(float* out, const float* a, const float* b, int n,
                                     Strided s, int op) {
    TG_GRID_LOOP(i, n) {
        int oa, ob;
        tg_offsets(s, i, oa, ob);
        out[i] = tg_binary_op(a[oa], b[ob], op);
    }
}

// The vectorised kernels: contiguous operands of the output's size, 16-byte aligned (the
// lowering checks), four elements per thread through float4 loads and stores, then the
// last n % 4 one by one; no index arithmetic but i.
#define TG_VEC4(i, n, BODY4, BODY1) do { \
        const int n4 = (n) >> 2; \
        TG_GRID_LOOP(i, n4) { BODY4; } \
        for (int i = 4 * n4 + blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
             i += gridDim.x * blockDim.x) { BODY1; } \
    } while (0)

extern "C" __global__ void tg_binary_vec(float* out, const float* a, const float* b, int n,
                                         int op) {
    TG_VEC4(i, n, {
        float4 x = reinterpret_cast<const float4*>(a)[i];
        float4 y = reinterpret_cast<const float4*>(b)[i];
        float4 r;
        r.x = tg_binary_op(x.x, y.x, op);
        r.y = tg_binary_op(x.y, y.y, op);
        r.z = tg_binary_op(x.z, y.z, op);
        r.w = tg_binary_op(x.w, y.w, op);
        reinterpret_cast<float4*>(out)[i] = r;
    }, out[i] = tg_binary_op(a[i], b[i], op));
}

extern "C" __global__ void tg_scale_vec(float* out, const float* x, int n, float s) {
    TG_VEC4(i, n, {
        float4 v = reinterpret_cast<const float4*>(x)[i];
        float4 r;
        r.x = __fmul_rn(v.x, s);
        r.y = __fmul_rn(v.y, s);
        r.z = __fmul_rn(v.z, s);
        r.w = __fmul_rn(v.w, s);
        reinterpret_cast<float4*>(out)[i] = r;
    }, out[i] = __fmul_rn(x[i], s));
}

extern "C" __global__ void tg_scale(float* out, const float* x, int n, float s) {
    TG_GRID_LOOP(i, n) out[i] = __fmul_rn(x[i], s);
}

// SiLU x * sigmoid(x) and its backward g * s * (1 + x * (1 - s)), left to right as numpy
// evaluates it: device functions, so the fused gated kernels (gated.cu) round alike.
__device__ __forceinline__ float tg_silu_at(float x) { return __fmul_rn(x, tg_sigmoid(x)); }

__device__ __forceinline__ float tg_silu_back_at(float x, float g) {
    float s = tg_sigmoid(x);
    float t = __fadd_rn(1.0f, __fmul_rn(x, __fsub_rn(1.0f, s)));
    return __fmul_rn(__fmul_rn(g, s), t);
}

extern "C" __global__ void tg_silu(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = tg_silu_at(x[i]);
}

extern "C" __global__ void tg_silu_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) out[i] = tg_silu_back_at(x[i], g[i]);
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
__device__ __forceinline__ float tg_gelu_at(float x) {
    return __fmul_rn(x, __fmul_rn(0.5f, __fadd_rn(1.0f, tg_gelu_tanh(x))));
}

// g * (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3a x^2)), left to right as numpy evaluates it.
__device__ __forceinline__ float tg_gelu_back_at(float x, float g) {
    float t = tg_gelu_tanh(x);
    float outer = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
    float inner = __fmul_rn(__fmul_rn(0.5f, x), __fsub_rn(1.0f, __fmul_rn(t, t)));
    inner = __fmul_rn(inner, TG_GELU_C);
    float poly = __fadd_rn(1.0f, __fmul_rn(__fmul_rn(3.0f * TG_GELU_A, x), x));
    return __fmul_rn(g, __fadd_rn(outer, __fmul_rn(inner, poly)));
}

extern "C" __global__ void tg_gelu(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = tg_gelu_at(x[i]);
}

extern "C" __global__ void tg_gelu_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) out[i] = tg_gelu_back_at(x[i], g[i]);
}

// Soft capping: cap * tanh(x / cap), and its backward g * (1 - t^2), t = tanh(x / cap).
extern "C" __global__ void tg_softcap(float* out, const float* x, int n, float cap) {
    TG_GRID_LOOP(i, n) out[i] = __fmul_rn(tanhf(__fdiv_rn(x[i], cap)), cap);
}

extern "C" __global__ void tg_softcap_back(float* out, const float* x, const float* g, int n,
                                           float cap) {
    TG_GRID_LOOP(i, n) {
        float t = tanhf(__fdiv_rn(x[i], cap));
        out[i] = __fmul_rn(g[i], __fsub_rn(1.0f, __fmul_rn(t, t)));
    }
}

// The logistic function (tg_sigmoid of common.cuh) and its backward g * s * (1 - s).
extern "C" __global__ void tg_sigmoid_op(float* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = tg_sigmoid(x[i]);
}

extern "C" __global__ void tg_sigmoid_back(float* out, const float* x, const float* g, int n) {
    TG_GRID_LOOP(i, n) {
        float s = tg_sigmoid(x[i]);
        out[i] = __fmul_rn(__fmul_rn(g[i], s), __fsub_rn(1.0f, s));
    }
}

// gpt-oss's clamped SwiGLU: gc = min(gate, limit), uc = clamp(up, -limit, limit),
// out = gc * sigmoid(alpha gc) * (uc + 1).
__device__ __forceinline__ void tg_swiglu_oai_parts(float gate, float up, float alpha,
                                                    float limit, float& gc, float& uc,
                                                    float& s) {
    gc = fminf(gate, limit);
    uc = fminf(fmaxf(up, -limit), limit);
    s = tg_sigmoid(__fmul_rn(alpha, gc));
}

extern "C" __global__ void tg_swiglu_oai(float* out, const float* gate, const float* up, int n,
                                         float alpha, float limit) {
    TG_GRID_LOOP(i, n) {
        float gc, uc, s;
        tg_swiglu_oai_parts(gate[i], up[i], alpha, limit, gc, uc, s);
        out[i] = __fmul_rn(__fmul_rn(gc, s), __fadd_rn(uc, 1.0f));
    }
}

// wrt 0: d gate = g (uc + 1) (s + alpha gc s (1 - s)) where gate <= limit;
// wrt 1: d up = g gc s where |up| <= limit.
extern "C" __global__ void tg_swiglu_oai_back(float* out, const float* gate, const float* up,
                                              const float* g, int n, float alpha, float limit,
                                              int wrt) {
    TG_GRID_LOOP(i, n) {
        float gc, uc, s;
        tg_swiglu_oai_parts(gate[i], up[i], alpha, limit, gc, uc, s);
        if (wrt == 0) {
            float ds = __fmul_rn(__fmul_rn(__fmul_rn(alpha, gc), s), __fsub_rn(1.0f, s));
            out[i] = gate[i] <= limit
                ? __fmul_rn(__fmul_rn(g[i], __fadd_rn(uc, 1.0f)), __fadd_rn(s, ds)) : 0.0f;
        } else {
            out[i] = fabsf(up[i]) <= limit ? __fmul_rn(g[i], __fmul_rn(gc, s)) : 0.0f;
        }
    }
}
