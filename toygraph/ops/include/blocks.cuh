// Per-element decode of the GGUF block formats, shared by the dequantize kernels
// (dequant.cu) and the fused quantized matmul / get_rows kernels (qmatmul.cu), so the two
// paths cannot disagree. Byte offsets are gguf/blocks.py's LAYOUT and block sizes its BLOCK,
// which blocks.c_defines emits as TG_<FMT>_<FIELD>, TG_<FMT>_QK and TG_<FMT>_BYTES ahead of
// this file.
//
// Each format is a struct: QK (elements per block), BYTES (bytes per block) and
// at(blk, i), element i of the block at blk, computed in gguf/blocks.py's (ggml's) f32
// rounding order with explicitly rounded intrinsics, so no FMA contraction can change a bit.

__device__ __forceinline__ int tg_nib32(const unsigned char* qs, int i) {
    return i < 16 ? (qs[i] & 0x0F) : (qs[i - 16] >> 4);
}

// Bit i of Q5_0/Q5_1's little-endian 32-bit qh field, as bit 4 of the value.
__device__ __forceinline__ int tg_qh_bit(const unsigned char* qh, int i) {
    return ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

// Q2_K/Q3_K's 2-bit value of element i (0..255) from their 64 qs bytes.
__device__ __forceinline__ int tg_crumb(const unsigned char* qs, int i) {
    int r = i % 128;
    return (qs[32 * (i / 128) + r % 32] >> (2 * (r / 32))) & 3;
}

// IQ4_NL's 16 non-linear levels (blocks.IQ4NL_VALUES, emitted by blocks.c_defines). A plain
// device array, not __constant__: lanes index it divergently, which constant memory
// would serialize.
__device__ const signed char tg_iq4nl_values[16] = {TG_IQ4NL_VALUES};

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

// q4_k / q5_k: (d*sc[j])*q - (dmin*m[j]); q5_k adds bit 4 of element l of sub-block j
// from (qh[l] >> j) & 1 (qh_off < 0 for q4_k).
__device__ __forceinline__ float tg_k_quant(const unsigned char* blk, int i, int d_off,
                                            int dmin_off, int sc_off, int qs_off, int qh_off) {
    int j = i / 32, l = i % 32;
    unsigned char byte = blk[qs_off + 32 * (j / 2) + l];
    int q = (j & 1) ? (byte >> 4) : (byte & 0x0F);
    if (qh_off >= 0) q |= ((blk[qh_off + l] >> j) & 1) << 4;
    int sc, mn;
    tg_k_scale(blk + sc_off, j, sc, mn);
    float d = __fmul_rn(tg_load_half(blk + d_off), (float)sc);
    float dm = __fmul_rn(tg_load_half(blk + dmin_off), (float)mn);
    return __fsub_rn(__fmul_rn(d, (float)q), dm);
}

struct TgF16 {
    static constexpr int QK = TG_F16_QK, BYTES = TG_F16_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int) {
        return tg_load_half(blk);
    }
};

struct TgBF16 {
    static constexpr int QK = TG_BF16_QK, BYTES = TG_BF16_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int) {
        return tg_bf16_to_float((unsigned short)(blk[0] | (blk[1] << 8)));
    }
};

struct TgQ8_0 {  // d | qs int8[32]
    static constexpr int QK = TG_Q8_0_QK, BYTES = TG_Q8_0_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        return __fmul_rn((float)(signed char)blk[TG_Q8_0_QS + i], tg_load_half(blk + TG_Q8_0_D));
    }
};

struct TgQ4_0 {  // d | qs[16]
    static constexpr int QK = TG_Q4_0_QK, BYTES = TG_Q4_0_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        float q = (float)tg_nib32(blk + TG_Q4_0_QS, i);
        return __fmul_rn(tg_load_half(blk + TG_Q4_0_D), __fsub_rn(q, 8.0f));
    }
};

struct TgQ4_1 {  // d | m | qs[16]
    static constexpr int QK = TG_Q4_1_QK, BYTES = TG_Q4_1_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        float q = (float)tg_nib32(blk + TG_Q4_1_QS, i);
        return __fadd_rn(__fmul_rn(tg_load_half(blk + TG_Q4_1_D), q), tg_load_half(blk + TG_Q4_1_M));
    }
};

struct TgQ5_0 {  // d | qh[4] | qs[16]
    static constexpr int QK = TG_Q5_0_QK, BYTES = TG_Q5_0_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        float q = (float)(tg_nib32(blk + TG_Q5_0_QS, i) | tg_qh_bit(blk + TG_Q5_0_QH, i));
        return __fmul_rn(tg_load_half(blk + TG_Q5_0_D), __fsub_rn(q, 16.0f));
    }
};

struct TgQ5_1 {  // d | m | qh[4] | qs[16]
    static constexpr int QK = TG_Q5_1_QK, BYTES = TG_Q5_1_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        float q = (float)(tg_nib32(blk + TG_Q5_1_QS, i) | tg_qh_bit(blk + TG_Q5_1_QH, i));
        return __fadd_rn(__fmul_rn(tg_load_half(blk + TG_Q5_1_D), q), tg_load_half(blk + TG_Q5_1_M));
    }
};

struct TgIQ4_NL {  // d | qs[16], values from the non-linear table
    static constexpr int QK = TG_IQ4_NL_QK, BYTES = TG_IQ4_NL_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        float v = (float)tg_iq4nl_values[tg_nib32(blk + TG_IQ4_NL_QS, i)];
        return __fmul_rn(tg_load_half(blk + TG_IQ4_NL_D), v);
    }
};

// MXFP4's e2m1 levels, doubled (blocks.MXFP4_VALUES).
__device__ const signed char tg_mxfp4_values[16] = {TG_MXFP4_VALUES};

struct TgMXFP4 {  // e | qs[16]: 2^(e - 128) * level (ggml_e8m0_to_fp32_half's bits)
    static constexpr int QK = TG_MXFP4_QK, BYTES = TG_MXFP4_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        unsigned e = blk[TG_MXFP4_E];
        float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23));
        return __fmul_rn(d, (float)tg_mxfp4_values[tg_nib32(blk + TG_MXFP4_QS, i)]);
    }
};

struct TgQ2_K {  // scales[16] | qs[64] | d | dmin: (d*(sc & 15))*q - dmin*(sc >> 4)
    static constexpr int QK = TG_Q2_K_QK, BYTES = TG_Q2_K_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        int sc = blk[TG_Q2_K_SCALES + i / 16];
        float dl = __fmul_rn(tg_load_half(blk + TG_Q2_K_D), (float)(sc & 15));
        float ml = __fmul_rn(tg_load_half(blk + TG_Q2_K_DMIN), (float)(sc >> 4));
        return __fsub_rn(__fmul_rn(dl, (float)tg_crumb(blk + TG_Q2_K_QS, i)), ml);
    }
};

struct TgQ3_K {  // hmask[32] | qs[64] | scales[12] | d: (d*(s - 32))*q
    static constexpr int QK = TG_Q3_K_QK, BYTES = TG_Q3_K_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        const unsigned char* sc = blk + TG_Q3_K_SCALES;
        int j = i / 16;
        int low = (j < 8) ? (sc[j] & 15) : (sc[j - 8] >> 4);
        int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        // the value is 4 lower where the hmask bit is clear
        int hbit = (blk[TG_Q3_K_HMASK + i % 32] >> (i / 32)) & 1;
        int q = tg_crumb(blk + TG_Q3_K_QS, i) - (hbit ? 0 : 4);
        float dl = __fmul_rn(tg_load_half(blk + TG_Q3_K_D), (float)((low | (high << 4)) - 32));
        return __fmul_rn(dl, (float)q);
    }
};

struct TgQ4_K {  // d | dmin | scales[12] | qs[128]
    static constexpr int QK = TG_Q4_K_QK, BYTES = TG_Q4_K_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        return tg_k_quant(blk, i, TG_Q4_K_D, TG_Q4_K_DMIN, TG_Q4_K_SCALES, TG_Q4_K_QS, -1);
    }
};

struct TgQ5_K {  // d | dmin | scales[12] | qh[32] | qs[128]
    static constexpr int QK = TG_Q5_K_QK, BYTES = TG_Q5_K_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        return tg_k_quant(blk, i, TG_Q5_K_D, TG_Q5_K_DMIN, TG_Q5_K_SCALES, TG_Q5_K_QS,
                          TG_Q5_K_QH);
    }
};

struct TgQ6_K {  // ql[128] | qh[64] | scales int8[16] | d
    static constexpr int QK = TG_Q6_K_QK, BYTES = TG_Q6_K_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        int h = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
        unsigned char lb = blk[TG_Q6_K_QL + 64 * h + l + ((quarter & 1) ? 32 : 0)];
        int lo = (quarter >= 2) ? (lb >> 4) : (lb & 0x0F);
        int hi = (blk[TG_Q6_K_QH + 32 * h + l] >> (2 * quarter)) & 3;
        float q = (float)(lo | (hi << 4));
        float d = __fmul_rn(tg_load_half(blk + TG_Q6_K_D),
                            (float)(signed char)blk[TG_Q6_K_SCALES + i / 16]);
        return __fmul_rn(d, __fsub_rn(q, 32.0f));
    }
};

struct TgIQ4_XS {  // d | scales_h u16 | scales_l[4] | qs[128]: 8 IQ4_NL-like runs of 32
    static constexpr int QK = TG_IQ4_XS_QK, BYTES = TG_IQ4_XS_BYTES;
    static __device__ __forceinline__ float at(const unsigned char* blk, int i) {
        int j = i / 32;
        int scales_h = blk[TG_IQ4_XS_SCALES_H] | (blk[TG_IQ4_XS_SCALES_H + 1] << 8);
        int ls = ((blk[TG_IQ4_XS_SCALES_L + j / 2] >> (4 * (j % 2))) & 15)
                 | (((scales_h >> (2 * j)) & 3) << 4);
        float dl = __fmul_rn(tg_load_half(blk + TG_IQ4_XS_D), (float)(ls - 32));
        float v = (float)tg_iq4nl_values[tg_nib32(blk + TG_IQ4_XS_QS + 16 * j, i % 32)];
        return __fmul_rn(dl, v);
    }
};

// Element e of a run of F blocks (a whole tensor, or one row of one).
template <class F>
__device__ __forceinline__ float tg_dequant_at(const unsigned char* raw, long long e) {
    return F::at(raw + (e / F::QK) * F::BYTES, (int)(e % F::QK));
}
