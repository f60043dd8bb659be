// The stochastic family's replay kernel (replay.h): dropout, numpy's (and stochastic.cu's)
// counter-based mask bit for bit: unsigned 32-bit hashes of (seed, salt, step, micro-batch,
// element index), the step and micro-batch read from the hp row when the node runs.

// MurmurHash3's 32-bit finalizer (numpy.py's fmix32).
static inline uint32_t dropout_fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

// x times scale where element i is kept ((h_i >> 8) >= threshold), else 0; x itself at
// step 0 (evaluation) or a threshold of 0. p: out, x, hp (f32 row); i: n, threshold,
// seed, salt, step's and micro-batch's entries of hp; f: scale (1 / (1 - p) in f32).
TG_REPLAY_KERNEL(dropout) {
    float* out = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *hp = (const float*)n.p[2];
    const int64_t count = n.i[0];
    const uint32_t threshold = (uint32_t)n.i[1];
    // int(hp[t]) as numpy takes it (truncated), hashed by its low 32 bits
    const int64_t step = (int64_t)hp[n.i[4]], micro = (int64_t)hp[n.i[5]];
    if (step == 0 || threshold == 0) {
        memcpy(out, x, (size_t)count * 4);
        return 0;
    }
    uint32_t key = dropout_fmix32((uint32_t)n.i[2] ^ 0x9E3779B9u);
    for (uint32_t v : {(uint32_t)n.i[3], (uint32_t)step, (uint32_t)micro}) key = dropout_fmix32(key ^ v);
    const uint32_t mix = dropout_fmix32(key ^ 0x68E31DA4u);
    const float scale = (float)n.f[0];
    replay_for(count, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const uint32_t h = dropout_fmix32(dropout_fmix32((uint32_t)i + key) ^ mix);
            out[i] = (h >> 8) >= threshold ? x[i] * scale : 0.0f;
        }
    });
    return 0;
}
