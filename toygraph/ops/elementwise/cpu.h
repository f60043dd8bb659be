// The elementwise family's replay kernels (replay.h): add, sub, mul, scale over n elements
// of f32 arrays of one shape. p: out, a[, b]; i: n; f: s (scale).

template <class F>
static void elementwise(const ReplayNode& n, F&& f) {
    float* out = (float*)n.p[0];
    const float* a = (const float*)n.p[1];
    const float* b = (const float*)n.p[2];
    replay_for(n.i[0], 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) out[i] = f(a[i], b ? b[i] : 0.0f);
    });
}

TG_REPLAY_KERNEL(add) {
    elementwise(n, [](float a, float b) { return a + b; });
    return 0;
}

TG_REPLAY_KERNEL(sub) {
    elementwise(n, [](float a, float b) { return a - b; });
    return 0;
}

TG_REPLAY_KERNEL(mul) {
    elementwise(n, [](float a, float b) { return a * b; });
    return 0;
}

TG_REPLAY_KERNEL(scale) {
    const float s = (float)n.f[0];
    elementwise(n, [s](float a, float) { return a * s; });
    return 0;
}
