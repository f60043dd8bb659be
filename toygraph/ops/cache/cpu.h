// The cache family's replay kernel (replay.h): cache_write, value [lead, T, d] into rows
// [start, start + T) of cache [lead, L, d], then the whole cache into out when out is not
// the cache itself (the numpy backend makes them one buffer; see numpy_backend.py).
// p: out, cache, value, start (i32 [1]); i: lead, L, T, d.
TG_REPLAY_KERNEL(cache_write) {
    float* out = (float*)n.p[0];
    float* cache = (float*)n.p[1];
    const float* value = (const float*)n.p[2];
    const int64_t start = *(const int32_t*)n.p[3];
    const int64_t lead = n.i[0], L = n.i[1], T = n.i[2], d = n.i[3];
    if (start < 0 || start + T > L) return -3;   // the session checks uploads; never write past
    for (int64_t r = 0; r < lead; r++)
        memcpy(cache + (r * L + start) * d, value + r * T * d, (size_t)(T * d) * 4);
    if (out != cache) memcpy(out, cache, (size_t)(lead * L * d) * 4);
    return 0;
}
