// The gated family's replay kernels (replay.h): glu and glu_back, act(gate) * up with act
// silu (0) or gelu's tanh form (1), each element computed by the elementwise family's
// activations (ops/elementwise/cpu.h, assembled before this file), as the numpy kernels
// call the elementwise ones.

// Over n elements of up to four inputs and two outputs, whole vectors then a padded tail:
// f(x[0..3], y[0..1]) reads vectors x and writes vectors y.
template <class F>
static void glu_map(int64_t n, const float* const* in, int n_in, float* const* out, int n_out, F&& f) {
    replay_for((n + VW - 1) / VW, VW, [&](int64_t v0, int64_t v1) {
        for (int64_t v = v0; v < v1; v++) {
            const int64_t i = v * VW, m = n - i < VW ? n - i : VW;
            vf x[4], y[2];
            for (int a = 0; a < n_in; a++) {
                if (m == VW) x[a] = vf_load(in[a] + i);
                else {
                    float buf[VW] = {0};
                    memcpy(buf, in[a] + i, (size_t)m * 4);
                    x[a] = vf_load(buf);
                }
            }
            f(x, y);
            for (int b = 0; b < n_out; b++) {
                if (m == VW) vf_store(out[b] + i, y[b]);
                else {
                    float buf[VW];
                    vf_store(buf, y[b]);
                    memcpy(out[b] + i, buf, (size_t)m * 4);
                }
            }
        }
    });
}

// out = act(gate) * up. p: out, gate, up; i: n, act.
TG_REPLAY_KERNEL(glu) {
    const float* in[2] = {(const float*)n.p[1], (const float*)n.p[2]};
    float* out[1] = {(float*)n.p[0]};
    const bool gelu = n.i[1] == 1;
    glu_map(n.i[0], in, 2, out, 1, [gelu](const vf* x, vf* y) {
        y[0] = (gelu ? ew_gelu(x[0]) : ew_silu(x[0])) * x[1];
    });
    return 0;
}

// d gate = act'(gate) (g up) at out, d up = g act(gate) at out + up_at.
// p: out, gate, up, g; i: n, act, up_at.
TG_REPLAY_KERNEL(glu_back) {
    const float* in[3] = {(const float*)n.p[1], (const float*)n.p[2], (const float*)n.p[3]};
    float* out[2] = {(float*)n.p[0], (float*)n.p[0] + n.i[2]};
    const bool gelu = n.i[1] == 1;
    glu_map(n.i[0], in, 3, out, 2, [gelu](const vf* x, vf* y) {
        const vf gu = x[2] * x[1];
        y[0] = gelu ? ew_gelu_back(x[0], gu) : ew_silu_back(x[0], gu);
        y[1] = x[2] * (gelu ? ew_gelu(x[0]) : ew_silu(x[0]));
    });
    return 0;
}
