// Rotary embedding (ops/rotary/).

// Rotary embedding of x [rows = batch*seq*heads, D] at pos [batch*seq]; one thread per
// element. Pair i at position p turns by freq_scale * p * base^(-2i/dims) / factors[i]
// (factors: the [dims/2] frequency factors, or nullptr for none), in double and then cast
// to f32, exactly as the numpy kernel computes it. x and out may be kept in bf16 (bit 0 and
// TG_OUT_BF16 of `bf16`, common.cuh); the rotation is f32 either way.
extern "C" __global__ void tg_rope(void* out, const void* x, const int* pos,
                                   const float* factors, int n, int heads, int D, int dims,
                                   double base, double freq_scale, int neox, int inverse,
                                   int bf16) {
    TG_GRID_LOOP(e, n) {
        int row = e / D, j = e - row * D;
        const long long xr = (long long)row * D;
        if (j >= dims) {
            tg_stx(out, e, tg_ldx(x, xr + j, bf16, 0), bf16);
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
        float x0 = tg_ldx(x, xr + i0, bf16, 0), x1 = tg_ldx(x, xr + i1, bf16, 0);
        tg_stx(out, e, second ? __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c))
                              : __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn)), bf16);
    }
}
