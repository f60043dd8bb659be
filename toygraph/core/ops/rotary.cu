// Rotary embedding (ops/rotary.py).

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
