// The rows family's replay kernels (replay.h): get_rows_back below; get_rows, rows ``ids`` of a [rows, K] table
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

// Columns of get_rows_back a task owns: 64 floats, a few cache lines of each row.
static const int64_t kRowsBackRun = 64;

// out [rows, K] = zeros, then g's row k added to out's row ids[k] for k in order: each
// output row's sum in the ids' order, in f32 from 0, as numpy's add.at (its bits). Tasks
// own runs of columns, so no two write one element and the order is the same at every
// thread count. p: out, g [n, K], ids (i32); i: n, K, rows.
TG_REPLAY_KERNEL(get_rows_back) {
    float* out = (float*)n.p[0];
    const float* g = (const float*)n.p[1];
    const int32_t* ids = (const int32_t*)n.p[2];
    const int64_t count = n.i[0], K = n.i[1], rows = n.i[2];
    for (int64_t k = 0; k < count; k++)
        if (ids[k] < 0 || ids[k] >= rows) return 1;
    replay_for(rows, K, [&](int64_t r0, int64_t r1) {
        memset(out + r0 * K, 0, (size_t)((r1 - r0) * K) * 4);
    });
    pool_for((K + kRowsBackRun - 1) / kRowsBackRun, [&](int64_t task, int) {
        const int64_t c0 = task * kRowsBackRun, c1 = c0 + kRowsBackRun < K ? c0 + kRowsBackRun : K;
        for (int64_t k = 0; k < count; k++) {
            float* o = out + (int64_t)ids[k] * K;
            const float* gk = g + k * K;
            for (int64_t c = c0; c < c1; c++) o[c] += gk[c];
        }
    });
    return 0;
}
