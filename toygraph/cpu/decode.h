// The block decoders: GGUF blocks to f32, bit for bit blocks.py's values (and gguf-py's).
//
// Built after the TG_<FMT>_* layout macros of blocks.c_defines(). Every element is computed
// in blocks.py's f32 rounding order (ggml's): the same products and differences, compiled
// with -ffp-contract=off and no fast-math, so no FMA or reassociation changes a bit. Each
// format decodes one block with its scales worked out once per sub-block; the loops over a
// sub-block's elements are branch-free runs of 16 or 32 that the compiler turns into vector
// code for the target (AVX-512, AVX2, NEON). A run of blocks is a loop over the inlined
// block function of one format (decode_blocks<F>), never an indirect call per block.

typedef unsigned char u8;

static const float kIq4nl[16] = {TG_IQ4NL_VALUES};
static const float kMxfp4[16] = {TG_MXFP4_VALUES};

static inline float bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// An IEEE half as f32, exactly (numpy's conversion: subnormals scaled, inf/nan kept).
static inline float half(const u8* p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) return bits_float(sign | 0x7F800000u | (m << 13));
    if (e == 0) {  // zero or subnormal: m * 2^-24 is exact in f32
        const float v = (float)m * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

// --- vectors of 16 elements ----------------------------------------------------------------
// GCC/Clang vector types: the compiler maps them to the target's registers (one AVX-512
// register, two AVX2 or four NEON ones), so one source serves every CPU. Conversions are
// exact (small integers to f32), and the arithmetic on them is the scalar code's, element
// by element: one IEEE operation each, in blocks.py's order.
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));

static const v16u32 kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const v16u32 kOnes = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

static inline v16u8 load16(const u8* p) {
    v16u8 v;
    std::memcpy(&v, p, 16);
    return v;
}
static inline void store16(float* y, v16f v) { std::memcpy(y, &v, 64); }
// A scalar in all 16 lanes. Written out because GCC 12, where 16 floats take two registers
// (AVX2), builds ``scalar * vector`` through 16 stores to the stack.
static inline v16f splat(float x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    const __m256 h = _mm256_set1_ps(x);
    v16f r;
    std::memcpy(&r, &h, 32);
    std::memcpy((char*)&r + 32, &h, 32);
    return r;
#else   // not (v16f){} + x: 0 + -0 is +0, and the sign of a zero scale must be kept
    return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
}
#if defined(__AVX2__) && !defined(__AVX512F__)
// GCC 12 converts the upper half of a 16-byte vector byte by byte when 16 ints take two
// registers: on AVX2, two zero-extending conversions, one per half.
static inline v16i32 widen(v16u8 v) {
    const __m128i x = (__m128i)v;
    const __m256i a = _mm256_cvtepu8_epi32(x), b = _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
    v16i32 r;
    std::memcpy(&r, &a, 32);
    std::memcpy((char*)&r + 32, &b, 32);
    return r;
}
#else
static inline v16i32 widen(v16u8 v) { return __builtin_convertvector(v, v16i32); }
#endif
// Signed bytes widened (through the unsigned widening, which every target vectorises:
// GCC 12 scalarises a signed char vector's conversion).
static inline v16i32 widen_signed(v16u8 v) { return widen((v16u8)(v ^ 0x80)) - 128; }
static inline v16f to_float(v16i32 v) { return __builtin_convertvector(v, v16f); }
static inline v16f to_float(v16u8 v) { return to_float(widen(v)); }
// table[idx & 15] for a 16-entry table (one permute on AVX-512; two and a blend a half on
// AVX2, whose permutes reach 8 lanes).
static inline v16f lookup16(const float* table, v16u8 idx) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    const __m256 t0 = _mm256_loadu_ps(table), t1 = _mm256_loadu_ps(table + 8);
    const v16i32 i = widen((v16u8)(idx & 15));
    __m256 half[2];
    for (int h = 0; h < 2; h++) {
        __m256i ih;
        std::memcpy(&ih, (const char*)&i + 32 * h, 32);
        const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(ih, 28));   // bit 3 -> sign
        half[h] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, ih),
                                   _mm256_permutevar8x32_ps(t1, ih), upper);
    }
    v16f r;
    std::memcpy(&r, half, 64);
    return r;
#else
    v16f t;
    std::memcpy(&t, table, 64);
    return __builtin_shuffle(t, widen((v16u8)(idx & 15)));
#endif
}
// Bits first..first+15 of a 32-bit word, one per element, shifted left by ``to``.
static inline v16i32 bits16(uint32_t word, int first, int to) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    const __m256i w = _mm256_set1_epi32((int)word), one = _mm256_set1_epi32(1);
    const __m256i lo = _mm256_srlv_epi32(w, _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                             _mm256_set1_epi32(first)));
    const __m256i hi = _mm256_srlv_epi32(w, _mm256_add_epi32(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
                                                             _mm256_set1_epi32(first)));
    const __m256i a = _mm256_slli_epi32(_mm256_and_si256(lo, one), to);
    const __m256i b = _mm256_slli_epi32(_mm256_and_si256(hi, one), to);
    v16i32 r;
    std::memcpy(&r, &a, 32);
    std::memcpy((char*)&r + 32, &b, 32);
    return r;
#else
    return (v16i32)((((v16u32){} + word) >> (kIota + (uint32_t)first)) & kOnes) << to;
#endif
}

// f16 without branches, a register's width at a time (native-width vectors: GCC 12 handles
// scalar operands of wider ones badly): the exponent is rebiased; inf/nan get the top
// exponent with their payload (numpy keeps signalling NaNs as they are, and so does this);
// subnormals are renormalised by an exact f32 subtraction. bf16 is the top half of an f32.
#if defined(__AVX512F__)
static const int kLanes = 16;
#elif defined(__AVX2__)
static const int kLanes = 8;
#else
static const int kLanes = 4;
#endif
typedef uint32_t vnu32 __attribute__((vector_size(4 * kLanes)));
typedef float vnf __attribute__((vector_size(4 * kLanes)));

static inline vnu32 f16_to_f32_bits(vnu32 h) {
    const vnu32 o = (h & 0x7FFF) << 13, exp = o & 0x0F800000u;
    const vnu32 inf_nan = (vnu32)(exp == 0x0F800000u) & (112u << 23);
    const vnu32 normal = o + (112u << 23) + inf_nan;
    const vnu32 shifted = o + (113u << 23);
    vnf renorm;
    std::memcpy(&renorm, &shifted, sizeof renorm);
    renorm = renorm - bits_float(113u << 23);
    vnu32 sub;
    std::memcpy(&sub, &renorm, sizeof sub);
    const vnu32 is_sub = (vnu32)(exp == 0);
    return ((sub & is_sub) | (normal & ~is_sub)) | ((h & 0x8000) << 16);
}

static inline vnu32 load_u16(const u8* p) {
    uint16_t h[kLanes];
    std::memcpy(h, p, 2 * kLanes);
    vnu32 v;
    for (int i = 0; i < kLanes; i++) v[i] = h[i];
    return v;
}

static inline void f16_run(const u8* __restrict b, float* __restrict y, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        const vnu32 f = f16_to_f32_bits(load_u16(b + 2 * i));
        std::memcpy(y + i, &f, sizeof f);
    }
    for (; i < n; i++) {
        vnu32 h = {};
        h[0] = (uint32_t)b[2 * i] | ((uint32_t)b[2 * i + 1] << 8);
        y[i] = bits_float(f16_to_f32_bits(h)[0]);
    }
}

static inline void bf16_run(const u8* __restrict b, float* __restrict y, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        const vnu32 f = load_u16(b + 2 * i) << 16;
        std::memcpy(y + i, &f, sizeof f);
    }
    for (; i < n; i++) y[i] = bits_float(((uint32_t)b[2 * i] | ((uint32_t)b[2 * i + 1] << 8)) << 16);
}

// --- one block each ---------------------------------------------------------------------
static inline void q8_0(const u8* __restrict b, float* __restrict y) {
    const float d = half(b + TG_Q8_0_D);
    for (int h = 0; h < 2; h++) {
        const v16i32 q = widen_signed(load16(b + TG_Q8_0_QS + 16 * h));
        store16(y + 16 * h, to_float(q) * splat(d));
    }
}

// The 32 four-bit values of a Q4_0/Q4_1/Q5/IQ4_NL/MXFP4 block are the 16 low nibbles of
// qs, then the 16 high ones; Q5's fifth bit i is bit i of the little-endian u32 qh.
static inline uint32_t qh_bits(const u8* qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    return bits;
}

static inline void q4_0(const u8* __restrict b, float* __restrict y) {
    const v16u8 qs = load16(b + TG_Q4_0_QS);
    const float d = half(b + TG_Q4_0_D);
    store16(y, splat(d) * (to_float((v16u8)(qs & 0x0F)) - splat(8.0f)));
    store16(y + 16, splat(d) * (to_float((v16u8)(qs >> 4)) - splat(8.0f)));
}

static inline void q4_1(const u8* __restrict b, float* __restrict y) {
    const v16u8 qs = load16(b + TG_Q4_1_QS);
    const float d = half(b + TG_Q4_1_D), m = half(b + TG_Q4_1_M);
    store16(y, splat(d) * to_float((v16u8)(qs & 0x0F)) + splat(m));
    store16(y + 16, splat(d) * to_float((v16u8)(qs >> 4)) + splat(m));
}

static inline void q5_0(const u8* __restrict b, float* __restrict y) {
    const v16u8 qs = load16(b + TG_Q5_0_QS);
    const uint32_t qh = qh_bits(b + TG_Q5_0_QH);
    const float d = half(b + TG_Q5_0_D);
    store16(y, splat(d) * (to_float(widen(qs & 0x0F) | bits16(qh, 0, 4)) - splat(16.0f)));
    store16(y + 16, splat(d) * (to_float(widen(qs >> 4) | bits16(qh, 16, 4)) - splat(16.0f)));
}

static inline void q5_1(const u8* __restrict b, float* __restrict y) {
    const v16u8 qs = load16(b + TG_Q5_1_QS);
    const uint32_t qh = qh_bits(b + TG_Q5_1_QH);
    const float d = half(b + TG_Q5_1_D), m = half(b + TG_Q5_1_M);
    store16(y, splat(d) * to_float(widen(qs & 0x0F) | bits16(qh, 0, 4)) + splat(m));
    store16(y + 16, splat(d) * to_float(widen(qs >> 4) | bits16(qh, 16, 4)) + splat(m));
}

static inline void iq4_nl(const u8* __restrict b, float* __restrict y) {
    const v16u8 qs = load16(b + TG_IQ4_NL_QS);
    const float d = half(b + TG_IQ4_NL_D);
    store16(y, splat(d) * lookup16(kIq4nl, qs));
    store16(y + 16, splat(d) * lookup16(kIq4nl, qs >> 4));
}

// 2^(e - 128) as ggml_e8m0_to_fp32_half builds it (denormals for e < 2).
static inline float e8m0_half(int e) {
    return bits_float(e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23));
}

static inline void mxfp4(const u8* __restrict b, float* __restrict y) {
    const v16u8 qs = load16(b + TG_MXFP4_QS);
    const float d = e8m0_half(b[TG_MXFP4_E]);
    store16(y, splat(d) * lookup16(kMxfp4, qs));
    store16(y + 16, splat(d) * lookup16(kMxfp4, qs >> 4));
}

// Shifts of byte vectors by a constant (x86 has no byte shifts: a variable count would be
// done element by element) and bit tests that need no shift at all.
template <int S>
static inline v16u8 shr(v16u8 v) { return (v16u8)(v >> S); }
static inline v16u8 bit_set(v16u8 v, int bit) { return (v16u8)((v & (u8)(1u << bit)) != 0); }

// Q2_K/Q3_K: element e = 128h + 32s + 16*half16 + i is (qs[32h + 16*half16 + i] >> 2s) & 3,
// in sub-block e / 16.
template <int S>
static inline void q2_k_crumbs(const u8* b, float d, float dmin, int h, int half16, v16u8 qs, float* y) {
    const int e0 = 128 * h + 32 * S + 16 * half16;
    const int sc = b[TG_Q2_K_SCALES + e0 / 16];
    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    store16(y + e0, splat(dl) * to_float((v16u8)(shr<2 * S>(qs) & 3)) - splat(ml));
}

static inline void q2_k(const u8* __restrict b, float* __restrict y) {
    const float d = half(b + TG_Q2_K_D), dmin = half(b + TG_Q2_K_DMIN);
    for (int h = 0; h < 2; h++) {
        for (int half16 = 0; half16 < 2; half16++) {
            const v16u8 qs = load16(b + TG_Q2_K_QS + 32 * h + 16 * half16);
            q2_k_crumbs<0>(b, d, dmin, h, half16, qs, y);
            q2_k_crumbs<1>(b, d, dmin, h, half16, qs, y);
            q2_k_crumbs<2>(b, d, dmin, h, half16, qs, y);
            q2_k_crumbs<3>(b, d, dmin, h, half16, qs, y);
        }
    }
}

// As Q2_K's crumbs, 4 lower where bit 4h + s of hmask[16*half16 + i] is clear; 6-bit scales.
template <int S>
static inline void q3_k_crumbs(const u8* b, float d, int h, int half16, v16u8 qs, v16u8 hmask, float* y) {
    const u8* sc = b + TG_Q3_K_SCALES;
    const int e0 = 128 * h + 32 * S + 16 * half16, j = e0 / 16;
    const int low = j < 8 ? (sc[j] & 15) : (sc[j - 8] >> 4);
    const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    const float dl = d * (float)((low | (high << 4)) - 32);
    const v16i32 clear = widen((v16u8)(~bit_set(hmask, 4 * h + S) & 4));
    store16(y + e0, splat(dl) * to_float(widen((v16u8)(shr<2 * S>(qs) & 3)) - clear));
}

static inline void q3_k(const u8* __restrict b, float* __restrict y) {
    const float d = half(b + TG_Q3_K_D);
    for (int h = 0; h < 2; h++) {
        for (int half16 = 0; half16 < 2; half16++) {
            const v16u8 qs = load16(b + TG_Q3_K_QS + 32 * h + 16 * half16);
            const v16u8 hmask = load16(b + TG_Q3_K_HMASK + 16 * half16);
            q3_k_crumbs<0>(b, d, h, half16, qs, hmask, y);
            q3_k_crumbs<1>(b, d, h, half16, qs, hmask, y);
            q3_k_crumbs<2>(b, d, h, half16, qs, hmask, y);
            q3_k_crumbs<3>(b, d, h, half16, qs, hmask, y);
        }
    }
}

// The 6-bit scale and min of sub-block j from the 12-byte K-quant scale field.
static inline void k_scale(const u8* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K and Q5_K: (d*sc[j])*q - dmin*m[j] over 8 sub-blocks of 32; sub-blocks 2p and 2p + 1
// read the low and high nibbles of qs[32p + l]; Q5_K adds bit j of qh[l] as bit 4.
template <bool Q5>
static inline void k_quant(const u8* __restrict b, float* __restrict y, int d_off, int dmin_off,
                           int sc_off, int qs_off, int qh_off) {
    const float d = half(b + d_off), dmin = half(b + dmin_off);
    for (int p = 0; p < 4; p++) {
        int sc0, mn0, sc1, mn1;
        k_scale(b + sc_off, 2 * p, &sc0, &mn0);
        k_scale(b + sc_off, 2 * p + 1, &sc1, &mn1);
        const float dl0 = d * (float)sc0, ml0 = dmin * (float)mn0;
        const float dl1 = d * (float)sc1, ml1 = dmin * (float)mn1;
        for (int l = 0; l < 32; l += 16) {
            const v16u8 src = load16(b + qs_off + 32 * p + l);
            v16u8 lo = src & 0x0F, hi = shr<4>(src);
            if (Q5) {
                const v16u8 qh = load16(b + qh_off + l);
                lo |= bit_set(qh, 2 * p) & 16;
                hi |= bit_set(qh, 2 * p + 1) & 16;
            }
            store16(y + 64 * p + l, splat(dl0) * to_float(lo) - splat(ml0));
            store16(y + 64 * p + 32 + l, splat(dl1) * to_float(hi) - splat(ml1));
        }
    }
}

static inline void q4_k(const u8* __restrict b, float* __restrict y) {
    k_quant<false>(b, y, TG_Q4_K_D, TG_Q4_K_DMIN, TG_Q4_K_SCALES, TG_Q4_K_QS, 0);
}

static inline void q5_k(const u8* __restrict b, float* __restrict y) {
    k_quant<true>(b, y, TG_Q5_K_D, TG_Q5_K_DMIN, TG_Q5_K_SCALES, TG_Q5_K_QS, TG_Q5_K_QH);
}

// Q6_K: element e = 128h + 32*quarter + l takes ql[64h + l (+32 for odd quarters)], its low
// nibble for quarters 0/1 and high for 2/3, plus bits 2*quarter of qh[32h + l] as bits 4-5.
template <int QUARTER>
static inline void q6_k_quarter(const u8* b, float d, int h, float* y) {
    const signed char* scales = (const signed char*)(b + TG_Q6_K_SCALES);
    for (int half16 = 0; half16 < 2; half16++) {  // two scales per 32 elements
        const int e0 = 128 * h + 32 * QUARTER + 16 * half16;
        const float dl = d * (float)scales[e0 / 16];
        const v16u8 ql = load16(b + TG_Q6_K_QL + 64 * h + ((QUARTER & 1) ? 32 : 0) + 16 * half16);
        const v16u8 qh = load16(b + TG_Q6_K_QH + 32 * h + 16 * half16);
        const v16u8 q = (v16u8)((shr<QUARTER >= 2 ? 4 : 0>(ql) & 0x0F) | ((shr<2 * QUARTER>(qh) & 3) << 4));
        store16(y + e0, splat(dl) * (to_float(q) - splat(32.0f)));
    }
}

static inline void q6_k(const u8* __restrict b, float* __restrict y) {
    const float d = half(b + TG_Q6_K_D);
    for (int h = 0; h < 2; h++) {
        q6_k_quarter<0>(b, d, h, y);
        q6_k_quarter<1>(b, d, h, y);
        q6_k_quarter<2>(b, d, h, y);
        q6_k_quarter<3>(b, d, h, y);
    }
}

static inline void iq4_xs(const u8* __restrict b, float* __restrict y) {
    const float d = half(b + TG_IQ4_XS_D);
    const int scales_h = b[TG_IQ4_XS_SCALES_H] | (b[TG_IQ4_XS_SCALES_H + 1] << 8);
    for (int j = 0; j < 8; j++) {
        const int ls = ((b[TG_IQ4_XS_SCALES_L + j / 2] >> (4 * (j % 2))) & 15)
                       | (((scales_h >> (2 * j)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        const v16u8 qs = load16(b + TG_IQ4_XS_QS + 16 * j);
        store16(y + 32 * j, splat(dl) * lookup16(kIq4nl, qs));
        store16(y + 32 * j + 16, splat(dl) * lookup16(kIq4nl, qs >> 4));
    }
}

// --- runs of blocks ----------------------------------------------------------------------
typedef void (*BlockFn)(const u8* __restrict, float* __restrict);

// f16 and bf16 are one-element blocks, so that every format has a block function of its
// name for the table below; a run of them is their vector loop above.
static inline void f16(const u8* __restrict b, float* __restrict y) { f16_run(b, y, 1); }
static inline void bf16(const u8* __restrict b, float* __restrict y) { bf16_run(b, y, 1); }

// n blocks of format F: its inlined block function in a loop (f16, bf16: their runs).
template <BlockFn F, int QK, int BYTES>
static void decode_blocks(const u8* __restrict raw, float* __restrict out, int64_t n) {
    if constexpr (F == f16) {
        f16_run(raw, out, n);
    } else if constexpr (F == bf16) {
        bf16_run(raw, out, n);
    } else {
        for (int64_t i = 0; i < n; i++) F(raw + i * BYTES, out + i * QK);
    }
}

typedef void (*RunFn)(const u8*, float*, int64_t);

// A format as the engine sees it: ``run`` decodes n whole blocks of qk elements (f16 and
// bf16 are one-element blocks).
struct Format {
    RunFn run;
    int qk, bytes;
};

#define TG_FORMAT(fmt, NAME) \
    {decode_blocks<fmt, TG_##NAME##_QK, TG_##NAME##_BYTES>, TG_##NAME##_QK, TG_##NAME##_BYTES},

// One per format of TG_BLOCK_FORMATS (blocks.c_defines), in its order: engine.py's FORMATS.
static const Format kFormats[] = {TG_BLOCK_FORMATS(TG_FORMAT)};
static const int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

// Elements [k0, k1) of one row (k0, k1 multiples of the block's qk, or k1 the row's end)
// into out[0 .. k1 - k0).
static inline void decode_row_part(const Format& f, const u8* row, int64_t k0, int64_t k1, float* out) {
    f.run(row + (k0 / f.qk) * f.bytes, out, (k1 - k0) / f.qk);
}
