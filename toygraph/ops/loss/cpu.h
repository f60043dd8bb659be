// The loss family's replay kernels (replay.h): cross_entropy, cross_entropy_back and
// count_valid over logits [N, V] and labels [N] (-1: ignored).

// The largest value of a row.
static inline float ce_max(const float* z, int64_t V) {
    float top = -INFINITY;
    for (int64_t j = 0; j < V; j++) top = z[j] > top ? z[j] : top;
    return top;
}

// The sum of exp(z - top) over a row, each exp also written to ``e`` when given: the
// vector lanes sum runs of 256 elements, each run's sum is added in f64, so a vocabulary
// of 262,144 rounds about as little as numpy's pairwise sum (one f32 chain would round
// V times).
static inline float ce_sum_exp(const float* z, int64_t V, float top, float* e) {
    double total = 0.0;
    for (int64_t j0 = 0; j0 < V; j0 += 256) {
        const int64_t j1 = j0 + 256 < V ? j0 + 256 : V;
        vf acc{};
        int64_t j = j0;
        for (; j + VW <= j1; j += VW) {
            const vf x = vf_exp(vf_load(z + j) - top);
            if (e) vf_store(e + j, x);
            acc += x;
        }
        float run = 0.0f;
        for (int l = 0; l < VW; l++) run += acc[l];
        for (; j < j1; j++) {
            float one[VW] = {0};
            one[0] = z[j] - top;
            const float x = vf_exp(vf_load(one))[0];
            if (e) e[j] = x;
            run += x;
        }
        total += (double)run;
    }
    return (float)total;
}

// The sum (or mean over the counted rows) of -log softmax(z)[label] over rows whose label
// is not ignored: each row's loss in f32, their sum in f64 in row order.
// p: out (one f32), logits, labels (i32); i: N, V, mean (0/1).
TG_REPLAY_KERNEL(cross_entropy) {
    float* out = (float*)n.p[0];
    const float* logits = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[2];
    const int64_t N = n.i[0], V = n.i[1];
    std::vector<float> loss((size_t)N, 0.0f);
    pool_for(N, [&](int64_t r, int) {
        if (labels[r] < 0) return;
        const float* z = logits + r * V;
        const float top = ce_max(z, V);
        loss[r] = logf(ce_sum_exp(z, V, top, nullptr)) - (z[labels[r]] - top);
    });
    double total = 0.0;
    int64_t counted = 0;
    for (int64_t r = 0; r < N; r++)
        if (labels[r] >= 0) {
            total += (double)loss[r];
            counted++;
        }
    *out = (float)(n.i[2] ? (counted ? total / (double)counted : 0.0) : total);
    return 0;
}

// (softmax(z) - onehot(label)) times g (over the counted rows for a mean), zero on ignored
// rows. p: out [N, V], logits, labels, g (one f32); i: N, V, mean.
TG_REPLAY_KERNEL(cross_entropy_back) {
    float* out = (float*)n.p[0];
    const float* logits = (const float*)n.p[1];
    const int32_t* labels = (const int32_t*)n.p[2];
    const float g = *(const float*)n.p[3];
    const int64_t N = n.i[0], V = n.i[1];
    int64_t counted = 0;
    for (int64_t r = 0; r < N; r++) counted += labels[r] >= 0;
    const float w = n.i[2] ? (counted ? g / (float)counted : 0.0f * g) : g;
    pool_for(N, [&](int64_t r, int) {
        const float* z = logits + r * V;
        float* o = out + r * V;
        const float sum = ce_sum_exp(z, V, ce_max(z, V), o);
        const bool valid = labels[r] >= 0;
        const float rw = valid ? w : 0.0f;
        vf_apply(o, o, V, [sum](vf x) { return x / sum; });
        if (valid) o[labels[r]] -= 1.0f;
        vf_apply(o, o, V, [rw](vf x) { return x * rw; });
    });
    return 0;
}

// The number of labels that are not ignored, as one f32. p: out, labels; i: N.
TG_REPLAY_KERNEL(count_valid) {
    const int32_t* labels = (const int32_t*)n.p[1];
    int64_t counted = 0;
    for (int64_t r = 0; r < n.i[0]; r++) counted += labels[r] >= 0;
    *(float*)n.p[0] = (float)counted;
    return 0;
}
