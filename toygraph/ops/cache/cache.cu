// The KV cache of generation (ops/cache/): rows written into a persistent cache in place.

// cache and out are [outer, L, d], value [outer, T, d]: rows [start, start + T) of the cache
// take value's rows, and out gets the whole cache after the write. Each element of the cache
// is read and written by one thread only, so the two need no barrier.
extern "C" __global__ void tg_cache_write(float* out, float* cache, const float* value,
                                          const int* start, int n, int L, int T, int d) {
    int s = start[0];
    TG_GRID_LOOP(i, n) {
        int r = (i / d) % L - s;
        float x = cache[i];
        if (r >= 0 && r < T) {
            x = value[((i / (d * L)) * T + r) * d + i % d];
            cache[i] = x;
        }
        out[i] = x;
    }
}
