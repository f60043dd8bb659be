// Dequantize GGUF block formats into f32, one thread per output element, with the decode
// functions of blocks.cuh (which the fused kernels of qmatmul.cu use too). `raw` is the
// tensor's block bytes, `n` its element count.

template <class F>
__device__ __forceinline__ void tg_deq(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) out[e] = tg_dequant_at<F>(raw, e);
}

// tg_deq_<fmt>, one per block format of TG_BLOCK_FORMATS (blocks.c_defines).
#define TG_DEQ_KERNEL(fmt, NAME)                                                          \
    extern "C" __global__ void tg_deq_##fmt(float* out, const unsigned char* raw, int n) { \
        tg_deq<Tg##NAME>(out, raw, n);                                                    \
    }
TG_BLOCK_FORMATS(TG_DEQ_KERNEL)
