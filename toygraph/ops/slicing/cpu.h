// The slicing family's replay kernel (replay.h): narrow_back (narrow is the shape family's
// strided copy). out [rows, width] = zeros, g [rows, length] at columns [start, start +
// length). p: out, g; i: rows, width, start, length.
TG_REPLAY_KERNEL(narrow_back) {
    float* out = (float*)n.p[0];
    const float* g = (const float*)n.p[1];
    const int64_t width = n.i[1], start = n.i[2], length = n.i[3];
    replay_for(n.i[0], width, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            float* o = out + r * width;
            memset(o, 0, (size_t)start * 4);
            memcpy(o + start, g + r * length, (size_t)length * 4);
            memset(o + start + length, 0, (size_t)(width - start - length) * 4);
        }
    });
    return 0;
}
