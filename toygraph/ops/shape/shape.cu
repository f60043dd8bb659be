// Kernels of the shape ops (ops/shape/): bitwise copies (reshape, contiguous, unpack),
// strided gathers (permute, expand), fills, and the sums (sum, sum_to), each a fixed-order
// tree or chain, so results are bit-identical run to run.

// Bitwise copies work for f32 and i32 alike (reshape/contiguous of token ids).
extern "C" __global__ void tg_copy(unsigned int* out, const unsigned int* x, int n) {
    TG_GRID_LOOP(i, n) out[i] = x[i];
}

// out[i] = x[offset of output index i under s.sa]: permute, expand (stride 0 for
// broadcast dims, grouped dims split into (groups, 0-stride repeat)).
extern "C" __global__ void tg_gather(unsigned int* out, const unsigned int* x, int n,
                                     Strided s) {
    TG_GRID_LOOP(i, n) out[i] = x[tg_offset_a(s, i)];
}

extern "C" __global__ void tg_fill(float* out, int n, float v) {
    TG_GRID_LOOP(i, n) out[i] = v;
}

// Sums: out[o] = sum_r x[kept(o) + red(r)], kept/red walking x's strides (sa).
// One block per output, for long reductions.
extern "C" __global__ void tg_reduce_block(float* out, const float* x, int n_out, Strided kept,
                                           Strided red, int n_red) {
    __shared__ float sh[TG_THREADS];
    for (int o = blockIdx.x; o < n_out; o += gridDim.x) {
        int base = tg_offset_a(kept, o);
        float acc = 0.0f;
        for (int r = threadIdx.x; r < n_red; r += blockDim.x) acc = __fadd_rn(acc, x[base + tg_offset_a(red, r)]);
        float s = tg_block_sum(acc, sh);
        if (threadIdx.x == 0) out[o] = s;
    }
}

// One thread per output, for many short reductions.
extern "C" __global__ void tg_reduce_thread(float* out, const float* x, int n_out, Strided kept,
                                            Strided red, int n_red) {
    TG_GRID_LOOP(o, n_out) {
        int base = tg_offset_a(kept, o);
        float acc = 0.0f;
        for (int r = 0; r < n_red; ++r) acc = __fadd_rn(acc, x[base + tg_offset_a(red, r)]);
        out[o] = acc;
    }
}
