// Dequantize GGUF block formats into f32, one thread per output element. Offsets follow
// quant.LAYOUT; the arithmetic keeps quant.py's (and ggml's) f32 rounding order.
// `raw` is the tensor's block bytes, `n` its element count.

extern "C" __global__ void tg_deq_f16(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(i, n) out[i] = tg_load_half(raw + 2 * (long long)i);
}

extern "C" __global__ void tg_deq_bf16(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(i, n) {
        const unsigned char* p = raw + 2 * (long long)i;
        out[i] = tg_bf16_to_float((unsigned short)(p[0] | (p[1] << 8)));
    }
}

// q8_0: d | qs int8[32]
extern "C" __global__ void tg_deq_q8_0(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) {
        const unsigned char* blk = raw + (long long)(e / 32) * 34;
        int i = e % 32;
        out[e] = __fmul_rn((float)(signed char)blk[2 + i], tg_load_half(blk));
    }
}

__device__ __forceinline__ int tg_nib32(const unsigned char* qs, int i) {
    return i < 16 ? (qs[i] & 0x0F) : (qs[i - 16] >> 4);
}

// q4_0: d | qs[16]
extern "C" __global__ void tg_deq_q4_0(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) {
        const unsigned char* blk = raw + (long long)(e / 32) * 18;
        float q = (float)tg_nib32(blk + 2, e % 32);
        out[e] = __fmul_rn(tg_load_half(blk), __fsub_rn(q, 8.0f));
    }
}

// q4_1: d | m | qs[16]
extern "C" __global__ void tg_deq_q4_1(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) {
        const unsigned char* blk = raw + (long long)(e / 32) * 20;
        float q = (float)tg_nib32(blk + 4, e % 32);
        out[e] = __fadd_rn(__fmul_rn(tg_load_half(blk), q), tg_load_half(blk + 2));
    }
}

// The 6-bit scale and min of sub-block j from the 12-byte K-quant scale field.
__device__ __forceinline__ void tg_k_scale(const unsigned char* s, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// q4_k: d | dmin | scales[12] | qs[128];  q5_k: d | dmin | scales[12] | qh[32] | qs[128]
__device__ __forceinline__ float tg_k_quant(const unsigned char* blk, int i, int qs_off,
                                            int qh_off) {
    int j = i / 32, l = i % 32;
    unsigned char byte = blk[qs_off + 32 * (j / 2) + l];
    int q = (j & 1) ? (byte >> 4) : (byte & 0x0F);
    if (qh_off >= 0) q |= ((blk[qh_off + l] >> j) & 1) << 4;
    int sc, mn;
    tg_k_scale(blk + 4, j, sc, mn);
    float d = __fmul_rn(tg_load_half(blk), (float)sc);
    float dm = __fmul_rn(tg_load_half(blk + 2), (float)mn);
    return __fsub_rn(__fmul_rn(d, (float)q), dm);
}

extern "C" __global__ void tg_deq_q4_k(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) out[e] = tg_k_quant(raw + (long long)(e / 256) * 144, e % 256, 16, -1);
}

extern "C" __global__ void tg_deq_q5_k(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) out[e] = tg_k_quant(raw + (long long)(e / 256) * 176, e % 256, 48, 16);
}

// q6_k: ql[128] | qh[64] | scales int8[16] | d
extern "C" __global__ void tg_deq_q6_k(float* out, const unsigned char* raw, int n) {
    TG_GRID_LOOP(e, n) {
        const unsigned char* blk = raw + (long long)(e / 256) * 210;
        int i = e % 256, h = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
        unsigned char lb = blk[64 * h + l + ((quarter & 1) ? 32 : 0)];
        int lo = (quarter >= 2) ? (lb >> 4) : (lb & 0x0F);
        int hi = (blk[128 + 32 * h + l] >> (2 * quarter)) & 3;
        float q = (float)(lo | (hi << 4));
        float d = __fmul_rn(tg_load_half(blk + 208), (float)(signed char)blk[192 + i / 16]);
        out[e] = __fmul_rn(d, __fsub_rn(q, 32.0f));
    }
}
