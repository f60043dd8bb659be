// The rows family's replay kernel (replay.h): get_rows, rows ``ids`` of a [rows, K] table
// in its GGUF blocks (decoded row by row, each value the whole decode's) or in f32.
// p: out [n, K], table, ids (i32); i: n, K, fmt (-1: f32), row_bytes.
TG_REPLAY_KERNEL(get_rows) {
    float* out = (float*)n.p[0];
    const u8* table = (const u8*)n.p[1];
    const int32_t* ids = (const int32_t*)n.p[2];
    const int64_t count = n.i[0], K = n.i[1], fmt = n.i[2], row_bytes = n.i[3];
    if (fmt >= kNumFormats) return -1;
    replay_for(count, K, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const u8* row = table + (int64_t)ids[r] * row_bytes;
            if (fmt < 0) memcpy(out + r * K, row, (size_t)K * 4);
            else decode_row_part(kFormats[fmt], row, 0, K, out + r * K);
        }
    });
    return 0;
}
