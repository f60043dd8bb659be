// The gated FFN activations (ops/gated.py) fused: act(gate) * up in one pass, and its
// backward writing d gate and d up in one pass. act: 0 SiLU, 1 GELU (tanh). Each value is
// rounded exactly as the separate kernels of elementwise.cu round it (their device
// functions), so fusing changes no bit.

__device__ __forceinline__ float tg_gate_act(float x, int act) {
    return act == 0 ? tg_silu_at(x) : tg_gelu_at(x);
}

extern "C" __global__ void tg_glu(float* out, const float* gate, const float* up, int n,
                                  int act) {
    TG_GRID_LOOP(i, n) out[i] = __fmul_rn(tg_gate_act(gate[i], act), up[i]);
}

// out[i] = d gate = act'(gate) (g * up) (the mul's gradient, then act's backward);
// out[up_at + i] = d up = g * act(gate). up_at keeps d up's start 256-byte aligned.
extern "C" __global__ void tg_glu_back(float* out, const float* gate, const float* up,
                                       const float* g, int n, int up_at, int act) {
    TG_GRID_LOOP(i, n) {
        float x = gate[i], gi = g[i];
        float gu = __fmul_rn(gi, up[i]);
        out[i] = act == 0 ? tg_silu_back_at(x, gu) : tg_gelu_back_at(x, gu);
        out[up_at + i] = __fmul_rn(gi, tg_gate_act(x, act));
    }
}
