// The gated FFN activations (ops/gated/) fused: act(gate) * up in one pass, and its
// backward writing d gate and d up in one pass. act: 0 SiLU, 1 GELU (tanh). Each value is
// rounded exactly as the separate kernels of elementwise.cu round it (their device
// functions), so fusing changes no bit.

__device__ __forceinline__ float tg_gate_act(float x, int act) {
    return act == 0 ? tg_silu_at(x) : tg_gelu_at(x);
}

// gate, up and out may each be kept in bf16 (bit 0, 1, TG_OUT_BF16 of `bf16`: common.cuh's
// tg_ldx / tg_stx); the arithmetic is f32 either way.
extern "C" __global__ void tg_glu(void* out, const void* gate, const void* up, int n, int act,
                                  int bf16) {
    TG_GRID_LOOP(i, n)
        tg_stx(out, i, __fmul_rn(tg_gate_act(tg_ldx(gate, i, bf16, 0), act),
                                 tg_ldx(up, i, bf16, 1)), bf16);
}

// out[i] = d gate = act'(gate) (g * up) (the mul's gradient, then act's backward);
// out[up_at + i] = d up = g * act(gate). up_at keeps d up's start 256-byte aligned (in
// bf16 too: gated.py's PACK_ALIGN). gate, up, g: bits 0-2 of `bf16`.
extern "C" __global__ void tg_glu_back(void* out, const void* gate, const void* up,
                                       const void* g, int n, int up_at, int act, int bf16) {
    TG_GRID_LOOP(i, n) {
        float x = tg_ldx(gate, i, bf16, 0), gi = tg_ldx(g, i, bf16, 2);
        float gu = __fmul_rn(gi, tg_ldx(up, i, bf16, 1));
        tg_stx(out, i, act == 0 ? tg_silu_back_at(x, gu) : tg_gelu_back_at(x, gu), bf16);
        tg_stx(out, (long long)up_at + i, __fmul_rn(gi, tg_gate_act(x, act)), bf16);
    }
}
