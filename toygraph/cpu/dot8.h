// Products of a few rows with 8-bit activations (x86 with AVX2; ARM with NEON, sdot where
// the CPU has the dot-product extension), llama.cpp's way: x is rounded per 32 columns to
// int8 with one f32 scale (d = max|x| / 127), and a block's integers meet x's in integer
// multiply-adds (AVX-512 VNNI's dpbusd, else AVX2's maddubs + madd; ARM's sdot, else
// smull + pairwise adds: 32 products in a few instructions, against the f32 kernels'
// widen, convert and FMA per 16). The block's scale times x's scale is applied once per 32
// to the integer partial sums. A weight's offset (q4_1/q5_1's min, q4_K/q5_K's -dmin*m, the
// centres -8, -16 of q4_0/q5_0) multiplies the sum of x's rounded values over the 32, so
// every weight meets the same rounded x and the error is sum w (x - x8), |x - x8| <= d/2.
// (With x's exact sum for the offset instead, the error would be sum (w - m)(x - x8): the
// offset-free part w - m of q4_1/q4_K is all of one sign and up to twice |w|, and it doubled
// SmolLM2's logit error in generation.) The tests state the bound; generation's greedy
// tokens and logits are compared with the f32 kernels' in bench/cpu_engine.py.
//
// The block kernels are written once, against a few primitives per instruction set: W32
// (32 weights as bytes, element order), P8 (8 int32 lanes, lane j the sum of products
// 4j..4j+3), Acc8 (8 f32 lanes). The integer sums are exact on every path, and the f32
// steps (the rounding of x, one FMA per lane per 32, the final sum's tree) are the same
// operations in the same order, so ARM's results are x86's bit for bit. A block is decoded
// once for all M rows of x (Rows below: row by row, or with AVX-512 two rows to a 512-bit
// register, which makes GRPO's 4-row step about half the dot work it was), and each row
// meets it in the one-row kernel's operations, so M rows give M one-row results.

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")   // as dot.h: a * b + c in this section is one FMA

#if defined(__AVX2__)
#define TG_DOT_Q8 1

typedef __m256i W32;
typedef __m256i P8;
typedef __m256 Acc8;

static inline W32 w_load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline W32 w_or(W32 a, W32 b) { return _mm256_or_si256(a, b); }
static inline W32 w_low4(W32 v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline W32 w_high4(W32 v) { return w_low4(_mm256_srli_epi16(v, 4)); }
// ((v >> s) & 1) << 4 per byte (s < 8: a 16-bit shift leaks nothing across bytes after the mask)
static inline W32 w_bit_as_16(W32 v, int s) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1)), 4);
}
// ((v >> s) & 3) << 4 per byte (q6_K's high bits)
static inline W32 w_2bits_as_16(W32 v, int s) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(3)), 4);
}
static inline W32 w_minus32(W32 v) { return _mm256_sub_epi8(v, _mm256_set1_epi8(32)); }

// 16 bytes of nibbles as 32 values: the low nibbles (elements 0..15), then the high ones.
static inline W32 w_nibbles(const u8* p) {
    const __m128i q = _mm_loadu_si128((const __m128i*)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// Bit i of 4 bytes as 0x10 in byte i (q5_0/q5_1's fifth bit).
static inline W32 w_fifth_bits(const u8* qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// 32 unsigned weights times 32 signed activations, summed in fours: 8 int32 lanes.
static inline P8 dot_bytes(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else  // pairs into int16 (|w| <= 128, |x| <= 127: no saturation), then pairs into int32
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

static inline P8 dot_u8s8(W32 w, const int8_t* xq) { return dot_bytes(w, w_load(xq)); }

// Signed weights (q8_0, q6_K's q - 32): |w| against x with w's sign.
static inline P8 dot_s8s8(W32 w, const int8_t* xq) {
    const __m256i x = w_load(xq);
    return dot_bytes(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline Acc8 acc_zero() { return _mm256_setzero_ps(); }

// acc += p * scale, lanes 0-3 scaled by ``lo`` and 4-7 by ``hi`` (one rounding each).
static inline void fma_block2(Acc8& acc, P8 p, float lo, float hi) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)), acc);
}

static inline void fma_block(Acc8& acc, P8 p, float scale) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), acc);
}

// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
static inline float hsum8(Acc8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One group of 32 x rounded to int8 into q; returns its scale d = max|x| / 127.
static inline float quantize32(const float* xg, int8_t* q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
    mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
    const float a = _mm_cvtss_f32(mx);
    const __m256 id = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // nearest
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)q, packed);
    return a / 127.0f;
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
#define TG_DOT_Q8 1

struct W32 { uint8x16_t lo, hi; };    // elements 0..15, 16..31
struct P8 { int32x4_t lo, hi; };      // lanes 0-3 (elements 0..15), 4-7 (16..31)
struct Acc8 { float32x4_t lo, hi; };

static inline W32 w_load(const void* p) {
    const u8* b = (const u8*)p;
    return {vld1q_u8(b), vld1q_u8(b + 16)};
}
static inline W32 w_or(W32 a, W32 b) { return {vorrq_u8(a.lo, b.lo), vorrq_u8(a.hi, b.hi)}; }
static inline W32 w_low4(W32 v) { return {vandq_u8(v.lo, vdupq_n_u8(0x0F)), vandq_u8(v.hi, vdupq_n_u8(0x0F))}; }
static inline W32 w_high4(W32 v) { return {vshrq_n_u8(v.lo, 4), vshrq_n_u8(v.hi, 4)}; }
static inline uint8x16_t bits_as_16(uint8x16_t v, int s, u8 mask) {
    return vshlq_n_u8(vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)-s)), vdupq_n_u8(mask)), 4);
}
static inline W32 w_bit_as_16(W32 v, int s) { return {bits_as_16(v.lo, s, 1), bits_as_16(v.hi, s, 1)}; }
static inline W32 w_2bits_as_16(W32 v, int s) { return {bits_as_16(v.lo, s, 3), bits_as_16(v.hi, s, 3)}; }
static inline W32 w_minus32(W32 v) { return {vsubq_u8(v.lo, vdupq_n_u8(32)), vsubq_u8(v.hi, vdupq_n_u8(32))}; }

static inline W32 w_nibbles(const u8* p) {
    const uint8x16_t q = vld1q_u8(p);
    return {vandq_u8(q, vdupq_n_u8(0x0F)), vshrq_n_u8(q, 4)};
}

static inline W32 w_fifth_bits(const u8* qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    const uint8x16_t word = vreinterpretq_u8_u32(vdupq_n_u32(bits));
    static const u8 lo_idx[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    static const u8 hi_idx[16] = {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    static const u8 bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t b = vld1q_u8(bit), sixteen = vdupq_n_u8(0x10);
    return {vandq_u8(vtstq_u8(vqtbl1q_u8(word, vld1q_u8(lo_idx)), b), sixteen),
            vandq_u8(vtstq_u8(vqtbl1q_u8(word, vld1q_u8(hi_idx)), b), sixteen)};
}

// 16 signed weights times 16 signed activations, summed in fours: 4 int32 lanes.
static inline int32x4_t dot16(int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), w, x);
#else  // products into int16 (|w|, |x| <= 128: no overflow), then pairs, then pairs again
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    const int16x8_t hi = vmull_high_s8(w, x);
    return vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#endif
}

// Every weight here fits a signed byte (nibbles and five bits are below 32, q8_0 and
// q6_K's q - 32 are signed), so both kinds are one signed product.
static inline P8 dot_s8s8(W32 w, const int8_t* xq) {
    return {dot16(vreinterpretq_s8_u8(w.lo), vld1q_s8(xq)),
            dot16(vreinterpretq_s8_u8(w.hi), vld1q_s8(xq + 16))};
}
static inline P8 dot_u8s8(W32 w, const int8_t* xq) { return dot_s8s8(w, xq); }

static inline Acc8 acc_zero() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }

static inline void fma_block2(Acc8& acc, P8 p, float lo, float hi) {
    acc.lo = vfmaq_f32(acc.lo, vcvtq_f32_s32(p.lo), vdupq_n_f32(lo));
    acc.hi = vfmaq_f32(acc.hi, vcvtq_f32_s32(p.hi), vdupq_n_f32(hi));
}

static inline void fma_block(Acc8& acc, P8 p, float scale) { fma_block2(acc, p, scale, scale); }

// The AVX2 sum's tree: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
static inline float hsum8(Acc8 v) {
    const float32x4_t s = vaddq_f32(v.lo, v.hi);
    const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

static inline float quantize32(const float* xg, int8_t* q) {
    float32x4_t v[8], amax = vdupq_n_f32(0.0f);
    for (int j = 0; j < 8; j++) {
        v[j] = vld1q_f32(xg + 4 * j);
        amax = vmaxq_f32(amax, vabsq_f32(v[j]));
    }
    const float a = vmaxvq_f32(amax);
    const float32x4_t id = vdupq_n_f32(a > 0.0f ? 127.0f / a : 0.0f);
    for (int j = 0; j < 8; j += 2) {   // nearest, ties to even, saturated as packs does
        const int16x8_t h = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(v[j], id))),
                                         vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(v[j + 1], id))));
        vst1_s8(q + 4 * j, vqmovn_s16(h));
    }
    return a / 127.0f;
}
#endif

#if defined(TG_DOT_Q8)
// x [M, K] rounded per 32, group by group: group g's M rows of 32 values lie together
// (q + 32 * (g * M + m)), as do their scales d and sums sq (at g * M + m), so that two
// rows' values are one 64-byte load for the AVX-512 pairs below, which also read each
// pair's two scales spread over 16 lanes (d2, a shuffle fewer per block and pair).
struct XQ {
    const int8_t* q;          // [K/32, M, 32]
    const float* d;           // [K/32, M] scale
    const float* sq;          // [K/32, M] d * (sum of the group's rounded values)
    const float* d2;          // [K/32, M/2, 16]: rows 2j and 2j + 1's d, 8 lanes each
};

// The sums of M rows of one row of W: per row 8 f32 lanes of block sums (Acc8) and the
// offsets' sum. A block kernel below decodes its weights once and hands them here with
// its scale a (and offset b): acc_m += (w . x_m) * (a * d_m), off_m += b * sq_m, the same
// operations for every row whatever M is, so a row's result is the one-row kernel's bit
// for bit. Row by row (everywhere but AVX-512, and there for one row):
template <int M>
struct RowByRow {
    Acc8 acc[M];
    float off[M];

    RowByRow() {
        for (int m = 0; m < M; m++) {
            acc[m] = acc_zero();
            off[m] = 0.0f;
        }
    }
    // weights as unsigned bytes (S false) or signed (q8_0, q6_K)
    template <bool S>
    void dot(W32 w, const XQ& x, int64_t g, float a) {
        for (int m = 0; m < M; m++) {
            const int8_t* xq = x.q + 32 * (g * M + m);
            fma_block(acc[m], S ? dot_s8s8(w, xq) : dot_u8s8(w, xq), a * x.d[g * M + m]);
        }
    }
    // q6_K: lanes 0-3 scaled by lo * (a * d_m), lanes 4-7 by hi * (a * d_m)
    void dot_halves(W32 w, const XQ& x, int64_t g, float a, float lo, float hi) {
        for (int m = 0; m < M; m++) {
            const float dx = a * x.d[g * M + m];
            fma_block2(acc[m], dot_s8s8(w, x.q + 32 * (g * M + m)), lo * dx, hi * dx);
        }
    }
    void offset(float b, const XQ& x, int64_t g) {
        for (int m = 0; m < M; m++) off[m] += b * x.sq[g * M + m];
    }
    float result(int m) const { return hsum8(acc[m]) + off[m]; }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
// AVX-512 (VNNI, BW, DQ, VL), two rows or more: two rows in one 512-bit register, row 2j in
// the low 256 bits and 2j + 1 in the high ones, so one dpbusd, one convert and one FMA
// serve both (a row's lanes see exactly the 256-bit code's operations); an odd last row
// takes the 256-bit path. The rows' scales and offsets are one vector of M lanes. (One
// row stays row by row: through this struct it measured slower, 31 -> 40 us a product.)
template <int M>
struct RowPairs {
    static const int P = M / 2;     // row pairs
    __m512 pair[P > 0 ? P : 1];
    Acc8 last;                      // row M - 1 when M is odd
    __m256 off;                     // lane m: row m's offsets (M <= 8)

    RowPairs() {
        static_assert(M <= 8, "one 8-lane vector of row offsets");
        for (int j = 0; j < P; j++) pair[j] = _mm512_setzero_ps();
        last = acc_zero();
        off = _mm256_setzero_ps();
    }
    static __m256 row_floats(const float* p) {   // lanes 0..M-1 of p, the rest 0
        return _mm256_maskz_loadu_ps((__mmask8)((1u << M) - 1), p);
    }
    // a * d of rows 2j (lanes 0-7) and 2j + 1 (8-15), group g
    static __m512 pair_scale(const XQ& x, int64_t g, int j, float a) {
        return _mm512_mul_ps(_mm512_set1_ps(a), _mm512_loadu_ps(x.d2 + 16 * (g * P + j)));
    }
    template <bool S>
    static __m512i dot_pair(__m512i w2, const int8_t* xq) {
        const __m512i x = _mm512_loadu_si512(xq), zero = _mm512_setzero_si512();
        if (!S) return _mm512_dpbusd_epi32(zero, w2, x);
        // |w| against x with w's sign (no 512-bit sign_epi8; where w = 0 the product is 0)
        return _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w2),
                                   _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w2), zero, x));
    }
    template <bool S>
    void dot(W32 w, const XQ& x, int64_t g, float a) {
        const int8_t* xq = x.q + 32 * g * M;
        if (P > 0) {
            const __m512i w2 = _mm512_broadcast_i64x4(w);
            for (int j = 0; j < P; j++)
                pair[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair<S>(w2, xq + 64 * j)),
                                          pair_scale(x, g, j, a), pair[j]);
        }
        if (M % 2) {
            const __m256i p = S ? dot_s8s8(w, xq + 32 * (M - 1)) : dot_u8s8(w, xq + 32 * (M - 1));
            fma_block(last, p, a * x.d[g * M + M - 1]);
        }
    }
    void dot_halves(W32 w, const XQ& x, int64_t g, float a, float lo, float hi) {
        const int8_t* xq = x.q + 32 * g * M;
        if (P > 0) {
            const __m512i w2 = _mm512_broadcast_i64x4(w);
            // lo in lanes 0-3 and 8-11 (each row's first 16 weights), hi in 4-7 and 12-15
            const __m512 lohi = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(lo), _mm512_set1_ps(hi));
            for (int j = 0; j < P; j++)
                pair[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair<true>(w2, xq + 64 * j)),
                                          _mm512_mul_ps(lohi, pair_scale(x, g, j, a)), pair[j]);
        }
        if (M % 2) {
            const float dx = a * x.d[g * M + M - 1];
            fma_block2(last, dot_s8s8(w, xq + 32 * (M - 1)), lo * dx, hi * dx);
        }
    }
    void offset(float b, const XQ& x, int64_t g) {
        off = _mm256_fmadd_ps(_mm256_set1_ps(b), row_floats(x.sq + g * M), off);
    }
    float result(int m) const {
        float o[8];
        _mm256_storeu_ps(o, off);
        const Acc8 a = m >= 2 * P ? last
                     : m % 2 ? _mm512_extractf32x8_ps(pair[m / 2], 1)
                             : _mm512_castps512_ps256(pair[m / 2]);
        return hsum8(a) + o[m];
    }
};

template <int M> struct Rows : RowPairs<M> {};
template <> struct Rows<1> : RowByRow<1> {};
#else
template <int M> struct Rows : RowByRow<M> {};
#endif

template <int M>
static inline void q8_q8_0(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    r.template dot<true>(w_load(b + TG_Q8_0_QS), x, g, scale16(b + TG_Q8_0_D));
}

template <int M>
static inline void q8_q4_0(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    const float d = scale16(b + TG_Q4_0_D);
    r.template dot<false>(w_nibbles(b + TG_Q4_0_QS), x, g, d);
    r.offset(-(8.0f * d), x, g);
}

template <int M>
static inline void q8_q4_1(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    r.template dot<false>(w_nibbles(b + TG_Q4_1_QS), x, g, scale16(b + TG_Q4_1_D));
    r.offset(scale16(b + TG_Q4_1_M), x, g);
}

template <int M>
static inline void q8_q5_0(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    const float d = scale16(b + TG_Q5_0_D);
    r.template dot<false>(w_or(w_nibbles(b + TG_Q5_0_QS), w_fifth_bits(b + TG_Q5_0_QH)), x, g, d);
    r.offset(-(16.0f * d), x, g);
}

template <int M>
static inline void q8_q5_1(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    r.template dot<false>(w_or(w_nibbles(b + TG_Q5_1_QS), w_fifth_bits(b + TG_Q5_1_QH)), x, g,
                          scale16(b + TG_Q5_1_D));
    r.offset(scale16(b + TG_Q5_1_M), x, g);
}

// Q4_K/Q5_K: 32 bytes of nibbles hold two groups of 32 (low nibbles, then high).
template <int M, bool Q5>
static inline void q8_k(const u8* b, const XQ& x, int64_t g, Rows<M>& r,
                        int sc_off, int qs_off, int qh_off) {
    const float d = scale16(b), dmin = scale16(b + 2);
    const W32 qh = Q5 ? w_load(b + qh_off) : W32{};
    for (int p = 0; p < 4; p++) {
        const W32 src = w_load(b + qs_off + 32 * p);
        W32 w[2] = {w_low4(src), w_high4(src)};
        if (Q5) {
            w[0] = w_or(w[0], w_bit_as_16(qh, 2 * p));
            w[1] = w_or(w[1], w_bit_as_16(qh, 2 * p + 1));
        }
        for (int h = 0; h < 2; h++) {
            int sc, mn;
            k_scale(b + sc_off, 2 * p + h, &sc, &mn);
            const int64_t gg = g + 2 * p + h;
            r.template dot<false>(w[h], x, gg, d * (float)sc);
            r.offset(-(dmin * (float)mn), x, gg);
        }
    }
}

template <int M>
static inline void q8_q4_k(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    q8_k<M, false>(b, x, g, r, TG_Q4_K_SCALES, TG_Q4_K_QS, 0);
}

template <int M>
static inline void q8_q5_k(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    q8_k<M, true>(b, x, g, r, TG_Q5_K_SCALES, TG_Q5_K_QS, TG_Q5_K_QH);
}

// Q6_K: per 32 elements two groups of 16 with their own scales: lanes 0-3 of the integer
// sums are the first group's (bytes 0-15), lanes 4-7 the second's.
template <int M>
static inline void q8_q6_k(const u8* b, const XQ& x, int64_t g, Rows<M>& r) {
    const float d = scale16(b + TG_Q6_K_D);
    const signed char* scales = (const signed char*)(b + TG_Q6_K_SCALES);
    for (int h = 0; h < 2; h++) {
        const W32 qh = w_load(b + TG_Q6_K_QH + 32 * h);
        for (int quarter = 0; quarter < 4; quarter++) {
            const W32 ql = w_load(b + TG_Q6_K_QL + 64 * h + (quarter & 1 ? 32 : 0));
            const W32 lo = quarter >= 2 ? w_high4(ql) : w_low4(ql);
            const W32 w = w_minus32(w_or(lo, w_2bits_as_16(qh, 2 * quarter)));
            const int e = 8 * h + 2 * quarter;   // scale index of the first group of 16
            r.dot_halves(w, x, g + 4 * h + quarter, d, (float)scales[e], (float)scales[e + 1]);
        }
    }
}

template <int M, int QK, int BYTES, void (*F)(const u8*, const XQ&, int64_t, Rows<M>&)>
static void dot_rows_q8(const Product& p, const XQ& x, int64_t n0, int64_t n1) {
    const int64_t blocks = p.K / QK;
    for (int64_t n = n0; n < n1; n++) {
        const u8* row = p.w + n * p.row_bytes;
        Rows<M> r;
        for (int64_t i = 0; i < blocks; i++) F(row + i * BYTES, x, i * (QK / 32), r);
        for (int m = 0; m < M; m++) p.c[m * p.ldc + n] = r.result(m);
    }
}

typedef void (*DotRowsQ8Fn)(const Product&, const XQ&, int64_t, int64_t);

#define TG_DOT_Q8(fn, NAME) {dot_rows_q8<1, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<1>>, \
    dot_rows_q8<2, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<2>>, \
    dot_rows_q8<3, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<3>>, \
    dot_rows_q8<4, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<4>>}

static const DotRowsQ8Fn kDotRowsQ8[][DOT_MAX_M] = {
    {}, {},                                           // f16, bf16
    TG_DOT_Q8(q8_q8_0, Q8_0), TG_DOT_Q8(q8_q4_0, Q4_0), TG_DOT_Q8(q8_q4_1, Q4_1),
    TG_DOT_Q8(q8_q5_0, Q5_0), TG_DOT_Q8(q8_q5_1, Q5_1), {},   // iq4_nl
    {}, {},                                           // q2_k, q3_k
    TG_DOT_Q8(q8_q4_k, Q4_K), TG_DOT_Q8(q8_q5_k, Q5_K), TG_DOT_Q8(q8_q6_k, Q6_K),
    {}, {},                                           // iq4_xs, mxfp4
};

// x [M, K] rounded per 32 into ``q`` (int8) with the scales d and sq = d * sum(q), in
// XQ's layout (group by group).
static void quantize_rows(const Product& p, int8_t* q, float* d, float* sq) {
    const int64_t groups = p.K / 32;
    for (int64_t m = 0; m < p.M; m++)
        for (int64_t g = 0; g < groups; g++) {
            int8_t* qg = q + 32 * (g * p.M + m);
            const float dg = quantize32(p.a + m * p.lda + 32 * g, qg);
            int qsum = 0;
            for (int k = 0; k < 32; k++) qsum += qg[k];
            d[g * p.M + m] = dg;
            sq[g * p.M + m] = dg * (float)qsum;
        }
}

// XQ's d2 from d: per group and row pair, row 2j's scale in 8 lanes then row 2j + 1's
// (filled on every target: a few floats per group of 32).
static void spread_pair_scales(int64_t M, int64_t groups, const float* d, float* d2) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < M / 2; j++)
            for (int l = 0; l < 16; l++) d2[16 * (g * (M / 2) + j) + l] = d[g * M + 2 * j + l / 8];
}

// p's x (M rows, K a multiple of 32) rounded for the 8-bit kernels, held in q and sums.
static XQ quantize_x(const Product& p, std::vector<int8_t>& q, std::vector<float>& sums) {
    const int64_t groups = p.K / 32;
    q.resize((size_t)(p.M * p.K));
    sums.resize((size_t)(2 * p.M * groups + 16 * (p.M / 2) * groups));
    float *d = sums.data(), *sq = d + p.M * groups, *d2 = sq + p.M * groups;
    quantize_rows(p, q.data(), d, sq);
    spread_pair_scales(p.M, groups, d, d2);
    return XQ{q.data(), d, sq, d2};
}

static bool matmul_dot_q8(Product& p) {
    const int fmt = (int)(p.f - kFormats);
    if (p.M > DOT_MAX_M || p.K % p.f->qk != 0 || p.K % 32 != 0) return false;
    const DotRowsQ8Fn fn = kDotRowsQ8[fmt][p.M - 1];
    if (!fn) return false;
    std::vector<int8_t> q;
    std::vector<float> sums;
    const XQ x = quantize_x(p, q, sums);
    const int64_t per = dot_rows_per_task(p.N);
    pool_for((p.N + per - 1) / per, [&](int64_t task, int) {
        const int64_t n0 = task * per, n1 = n0 + per < p.N ? n0 + per : p.N;
        fn(p, x, n0, n1);
    });
    return true;
}
#else
static bool matmul_dot_q8(Product&) { return false; }
#endif

#pragma GCC pop_options
