// dropout (ops/stochastic/): a counter-based mask from a 32-bit hash of (seed, salt,
// optimizer step, micro-batch, element index), unsigned integer arithmetic only, so the
// numpy kernel draws the same bits. hp[7] is the step (0: evaluation, the identity),
// hp[8] the micro-batch.

__device__ __forceinline__ unsigned int tg_fmix32(unsigned int h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

extern "C" __global__ void tg_dropout(float* out, const float* x, const float* hp, int n,
                                      int seed, int salt, int threshold, float scale) {
    unsigned int step = (unsigned int)hp[7], micro = (unsigned int)hp[8];
    if (step == 0u || threshold == 0) {
        TG_GRID_LOOP(i, n) out[i] = x[i];
        return;
    }
    unsigned int k = tg_fmix32((unsigned int)seed ^ 0x9e3779b9u);
    k = tg_fmix32(k ^ (unsigned int)salt);
    k = tg_fmix32(k ^ step);
    k = tg_fmix32(k ^ micro);
    unsigned int k2 = tg_fmix32(k ^ 0x68e31da4u);
    TG_GRID_LOOP(i, n) {
        unsigned int h = tg_fmix32(tg_fmix32((unsigned int)i + k) ^ k2);
        out[i] = (h >> 8) >= (unsigned int)threshold ? __fmul_rn(x[i], scale) : 0.0f;
    }
}
