// narrow (ops/slicing/): rows of `width` floats, the slice [start, start + length) of each.

extern "C" __global__ void tg_narrow(float* out, const float* x, int n, int width, int length,
                                     int start) {
    TG_GRID_LOOP(i, n) out[i] = x[(i / length) * width + start + i % length];
}

// The backward: the slice's gradient in place, zeros elsewhere (n = rows * width).
extern "C" __global__ void tg_narrow_back(float* out, const float* g, int n, int width,
                                          int length, int start) {
    TG_GRID_LOOP(i, n) {
        int c = i % width - start;
        out[i] = (c >= 0 && c < length) ? g[(i / width) * length + c] : 0.0f;
    }
}
