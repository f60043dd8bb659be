// Dequantize GGUF block formats into f32, one thread per output element, with the decode
// functions of blocks.cuh (which the fused kernels of qmatmul.cu use too). `raw` is the
// tensor's block bytes, `n` its element count.

template <class F>
__device__ __forceinline__ void tg_deq(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) out[e] = tg_dequant_at<F>(raw, e);
}

extern "C" __global__ void tg_deq_f16(float* out, const unsigned char* raw, int n) { tg_deq<TgF16>(out, raw, n); }
extern "C" __global__ void tg_deq_bf16(float* out, const unsigned char* raw, int n) { tg_deq<TgBF16>(out, raw, n); }
extern "C" __global__ void tg_deq_q8_0(float* out, const unsigned char* raw, int n) { tg_deq<TgQ8_0>(out, raw, n); }
extern "C" __global__ void tg_deq_q4_0(float* out, const unsigned char* raw, int n) { tg_deq<TgQ4_0>(out, raw, n); }
extern "C" __global__ void tg_deq_q4_1(float* out, const unsigned char* raw, int n) { tg_deq<TgQ4_1>(out, raw, n); }
extern "C" __global__ void tg_deq_q4_k(float* out, const unsigned char* raw, int n) { tg_deq<TgQ4_K>(out, raw, n); }
extern "C" __global__ void tg_deq_q5_k(float* out, const unsigned char* raw, int n) { tg_deq<TgQ5_K>(out, raw, n); }
extern "C" __global__ void tg_deq_q6_k(float* out, const unsigned char* raw, int n) { tg_deq<TgQ6_K>(out, raw, n); }
extern "C" __global__ void tg_deq_q5_0(float* out, const unsigned char* raw, int n) { tg_deq<TgQ5_0>(out, raw, n); }
extern "C" __global__ void tg_deq_q5_1(float* out, const unsigned char* raw, int n) { tg_deq<TgQ5_1>(out, raw, n); }
extern "C" __global__ void tg_deq_iq4_nl(float* out, const unsigned char* raw, int n) { tg_deq<TgIQ4_NL>(out, raw, n); }
extern "C" __global__ void tg_deq_q2_k(float* out, const unsigned char* raw, int n) { tg_deq<TgQ2_K>(out, raw, n); }
extern "C" __global__ void tg_deq_q3_k(float* out, const unsigned char* raw, int n) { tg_deq<TgQ3_K>(out, raw, n); }
extern "C" __global__ void tg_deq_iq4_xs(float* out, const unsigned char* raw, int n) { tg_deq<TgIQ4_XS>(out, raw, n); }
extern "C" __global__ void tg_deq_mxfp4(float* out, const unsigned char* raw, int n) { tg_deq<TgMXFP4>(out, raw, n); }
