// The numpy backend's block decoders: whole runs of GGUF blocks to f32, on several threads.
//
// Built by gguf/decode.py with the host compiler, after the TG_<FMT>_* layout macros of
// blocks.c_defines(). Every element is computed in blocks.py's f32 rounding order (ggml's):
// the same products and differences, compiled with -ffp-contract=off and no fast-math, so
// no FMA or reassociation can change a bit and the values equal blocks.dequantize's. Each
// format decodes one block at a time with its scales worked out once per sub-block, and
// the inner loops over a sub-block's elements are plain enough for the compiler to
// vectorise.
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

typedef unsigned char u8;

static const float kIq4nl[16] = {TG_IQ4NL_VALUES};

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

// --- one block each ---------------------------------------------------------------------
// f16 runs without branches, so the loop vectorises: the exponent is rebiased; inf/nan get
// the top exponent with their payload (numpy keeps signalling NaNs as they are, and so
// does this); subnormals are renormalised by an exact f32 subtraction.
static void f16_run(const u8* b, float* y, int64_t n) {
    const uint16_t* h = (const uint16_t*)b;
    const float magic = bits_float(113u << 23);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t o = (uint32_t)(h[i] & 0x7FFF) << 13, exp = o & 0x0F800000u;
        const uint32_t normal = o + (112u << 23) + (exp == 0x0F800000u ? (112u << 23) : 0u);
        uint32_t sub;
        const float renorm = bits_float(o + (113u << 23)) - magic;
        std::memcpy(&sub, &renorm, 4);
        y[i] = bits_float((exp == 0 ? sub : normal) | ((uint32_t)(h[i] & 0x8000) << 16));
    }
}

static void bf16_run(const u8* b, float* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = bits_float(((uint32_t)b[2 * i] | ((uint32_t)b[2 * i + 1] << 8)) << 16);
}

static void q8_0(const u8* b, float* y) {
    const float d = half(b + TG_Q8_0_D);
    const signed char* q = (const signed char*)(b + TG_Q8_0_QS);
    for (int i = 0; i < 32; i++) y[i] = (float)q[i] * d;
}

// The 32 four-bit values of a Q4_0/Q4_1/Q5/IQ4_NL run: low nibbles, then high nibbles.
static inline void nibbles32(const u8* qs, int* q) {
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0F;
        q[i + 16] = qs[i] >> 4;
    }
}

static inline void add_qh_bits(const u8* qh, int* q) {  // bit i of a little-endian u32
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    for (int i = 0; i < 32; i++) q[i] |= (int)((bits >> i) & 1) << 4;
}

static void q4_0(const u8* b, float* y) {
    int q[32];
    nibbles32(b + TG_Q4_0_QS, q);
    const float d = half(b + TG_Q4_0_D);
    for (int i = 0; i < 32; i++) y[i] = d * ((float)q[i] - 8.0f);
}

static void q4_1(const u8* b, float* y) {
    int q[32];
    nibbles32(b + TG_Q4_1_QS, q);
    const float d = half(b + TG_Q4_1_D), m = half(b + TG_Q4_1_M);
    for (int i = 0; i < 32; i++) y[i] = d * (float)q[i] + m;
}

static void q5_0(const u8* b, float* y) {
    int q[32];
    nibbles32(b + TG_Q5_0_QS, q);
    add_qh_bits(b + TG_Q5_0_QH, q);
    const float d = half(b + TG_Q5_0_D);
    for (int i = 0; i < 32; i++) y[i] = d * ((float)q[i] - 16.0f);
}

static void q5_1(const u8* b, float* y) {
    int q[32];
    nibbles32(b + TG_Q5_1_QS, q);
    add_qh_bits(b + TG_Q5_1_QH, q);
    const float d = half(b + TG_Q5_1_D), m = half(b + TG_Q5_1_M);
    for (int i = 0; i < 32; i++) y[i] = d * (float)q[i] + m;
}

static void iq4_nl(const u8* b, float* y) {
    int q[32];
    nibbles32(b + TG_IQ4_NL_QS, q);
    const float d = half(b + TG_IQ4_NL_D);
    for (int i = 0; i < 32; i++) y[i] = d * kIq4nl[q[i]];
}

// Q2_K/Q3_K: element e = 128h + 32s + l is (qs[32h + l] >> 2s) & 3, in sub-block e / 16.
static void q2_k(const u8* b, float* y) {
    const float d = half(b + TG_Q2_K_D), dmin = half(b + TG_Q2_K_DMIN);
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 4; s++) {
            for (int half16 = 0; half16 < 2; half16++) {
                const int e0 = 128 * h + 32 * s + 16 * half16;
                const int sc = b[TG_Q2_K_SCALES + e0 / 16];
                const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
                const u8* qs = b + TG_Q2_K_QS + 32 * h + 16 * half16;
                for (int i = 0; i < 16; i++) y[e0 + i] = dl * (float)((qs[i] >> (2 * s)) & 3) - ml;
            }
        }
    }
}

// As Q2_K's crumbs, 4 lower where bit 4h + s of hmask[l] is clear; 6-bit scales.
static void q3_k(const u8* b, float* y) {
    const float d = half(b + TG_Q3_K_D);
    const u8* sc = b + TG_Q3_K_SCALES;
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 4; s++) {
            for (int half16 = 0; half16 < 2; half16++) {
                const int e0 = 128 * h + 32 * s + 16 * half16, j = e0 / 16;
                const int low = j < 8 ? (sc[j] & 15) : (sc[j - 8] >> 4);
                const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
                const float dl = d * (float)((low | (high << 4)) - 32);
                const u8* qs = b + TG_Q3_K_QS + 32 * h + 16 * half16;
                const u8* hmask = b + TG_Q3_K_HMASK + 16 * half16;
                for (int i = 0; i < 16; i++) {
                    const int q = ((qs[i] >> (2 * s)) & 3) - (((hmask[i] >> (4 * h + s)) & 1) ? 0 : 4);
                    y[e0 + i] = dl * (float)q;
                }
            }
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

// Q4_K (qh == nullptr) and Q5_K: (d*sc[j])*q - dmin*m[j] over 8 sub-blocks of 32; sub-block
// j reads qs[32*(j/2) + l], low nibbles for even j, high for odd; Q5_K adds bit j of qh[l].
static inline void k_quant(const u8* b, float* y, int d_off, int dmin_off, int sc_off,
                           const u8* qs, const u8* qh) {
    const float d = half(b + d_off), dmin = half(b + dmin_off);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale(b + sc_off, j, &sc, &mn);
        const float dl = d * (float)sc, ml = dmin * (float)mn;
        const u8* src = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) {
            int q = (src[l] >> shift) & 0x0F;
            if (qh) q |= ((qh[l] >> j) & 1) << 4;
            y[32 * j + l] = dl * (float)q - ml;
        }
    }
}

static void q4_k(const u8* b, float* y) {
    k_quant(b, y, TG_Q4_K_D, TG_Q4_K_DMIN, TG_Q4_K_SCALES, b + TG_Q4_K_QS, nullptr);
}

static void q5_k(const u8* b, float* y) {
    k_quant(b, y, TG_Q5_K_D, TG_Q5_K_DMIN, TG_Q5_K_SCALES, b + TG_Q5_K_QS, b + TG_Q5_K_QH);
}

// Q6_K: element e = 128h + 32*quarter + l takes ql[64h + l (+32 for odd quarters)], its low
// nibble for quarters 0/1 and high for 2/3, plus bits 2*quarter of qh[32h + l] as bits 4-5.
static void q6_k(const u8* b, float* y) {
    const float d = half(b + TG_Q6_K_D);
    const signed char* scales = (const signed char*)(b + TG_Q6_K_SCALES);
    for (int h = 0; h < 2; h++) {
        for (int quarter = 0; quarter < 4; quarter++) {
            const u8* ql = b + TG_Q6_K_QL + 64 * h + ((quarter & 1) ? 32 : 0);
            const u8* qh = b + TG_Q6_K_QH + 32 * h;
            const int shift = quarter >= 2 ? 4 : 0;
            for (int half16 = 0; half16 < 2; half16++) {  // two scales per 32 elements
                const int e0 = 128 * h + 32 * quarter + 16 * half16;
                const float dl = d * (float)scales[e0 / 16];
                for (int i = 0; i < 16; i++) {
                    const int l = 16 * half16 + i;
                    const int q = ((ql[l] >> shift) & 0x0F) | (((qh[l] >> (2 * quarter)) & 3) << 4);
                    y[e0 + i] = dl * ((float)q - 32.0f);
                }
            }
        }
    }
}

static void iq4_xs(const u8* b, float* y) {
    const float d = half(b + TG_IQ4_XS_D);
    const int scales_h = b[TG_IQ4_XS_SCALES_H] | (b[TG_IQ4_XS_SCALES_H + 1] << 8);
    for (int j = 0; j < 8; j++) {
        const int ls = ((b[TG_IQ4_XS_SCALES_L + j / 2] >> (4 * (j % 2))) & 15)
                       | (((scales_h >> (2 * j)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        int q[32];
        nibbles32(b + TG_IQ4_XS_QS + 16 * j, q);
        for (int i = 0; i < 32; i++) y[32 * j + i] = dl * kIq4nl[q[i]];
    }
}

// --- the entry point --------------------------------------------------------------------
typedef void (*BlockFn)(const u8*, float*);

struct Format {
    BlockFn block;  // nullptr for the one-element "blocks" of f16/bf16
    int qk, bytes;
};

// In the order of decode.py's FORMATS.
static const Format kFormats[] = {
    {nullptr, 1, 2}, {nullptr, 1, 2},
    {q8_0, TG_Q8_0_QK, TG_Q8_0_BYTES}, {q4_0, TG_Q4_0_QK, TG_Q4_0_BYTES},
    {q4_1, TG_Q4_1_QK, TG_Q4_1_BYTES}, {q5_0, TG_Q5_0_QK, TG_Q5_0_BYTES},
    {q5_1, TG_Q5_1_QK, TG_Q5_1_BYTES}, {iq4_nl, TG_IQ4_NL_QK, TG_IQ4_NL_BYTES},
    {q2_k, TG_Q2_K_QK, TG_Q2_K_BYTES}, {q3_k, TG_Q3_K_QK, TG_Q3_K_BYTES},
    {q4_k, TG_Q4_K_QK, TG_Q4_K_BYTES}, {q5_k, TG_Q5_K_QK, TG_Q5_K_BYTES},
    {q6_k, TG_Q6_K_QK, TG_Q6_K_BYTES}, {iq4_xs, TG_IQ4_XS_QK, TG_IQ4_XS_BYTES},
};
static const int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

static void decode_range(int fmt, const u8* raw, float* out, int64_t first, int64_t end) {
    const Format& f = kFormats[fmt];
    if (!f.block) {  // f16 (0) or bf16 (1): element runs
        (fmt == 0 ? f16_run : bf16_run)(raw + 2 * first, out + first, end - first);
        return;
    }
    for (int64_t i = first; i < end; i++) f.block(raw + i * f.bytes, out + i * f.qk);
}

// Decode ``nblocks`` blocks of format ``fmt`` (an index of decode.py's FORMATS) from ``raw``
// into ``out`` (nblocks * QK floats) on ``nthreads`` threads. Returns 0, or -1 for an
// unknown format.
extern "C" __attribute__((visibility("default")))
int tg_decode_blocks(int fmt, const u8* raw, float* out, int64_t nblocks, int nthreads) {
    if (fmt < 0 || fmt >= kNumFormats) return -1;
    if (nthreads <= 1 || nblocks < 2 * nthreads) {
        decode_range(fmt, raw, out, 0, nblocks);
        return 0;
    }
    std::vector<std::thread> pool;
    const int64_t per = (nblocks + nthreads - 1) / nthreads;
    for (int t = 1; t < nthreads; t++) {
        const int64_t first = t * per, end = first + per < nblocks ? first + per : nblocks;
        if (first < end) pool.emplace_back(decode_range, fmt, raw, out, first, end);
    }
    decode_range(fmt, raw, out, 0, per < nblocks ? per : nblocks);
    for (auto& th : pool) th.join();
    return 0;
}
