// The vector type the kernels compute with, chosen by what the compiler targets: the
// library is built on the machine that runs it (-march=native, cached by the CPU's flags),
// so the preprocessor's view of the target *is* the runtime check. AVX-512, AVX2 with FMA
// and NEON get their registers; anything else a one-lane "vector" (plain scalar code).
//
// Vec: VL floats, for the GEMM's register tiles (gemm.h). load/store are unaligned;
// fma(a, b, c) = a * b + c with one rounding (the decoders never use it: they keep
// blocks.py's rounding order).
#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TG_SIMD "avx512"
typedef __m512 Vec;
static const int VL = 16;
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
static inline Vec vset1(float x) { return _mm512_set1_ps(x); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TG_SIMD "avx2"
typedef __m256 Vec;
static const int VL = 8;
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
static inline Vec vset1(float x) { return _mm256_set1_ps(x); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define TG_SIMD "neon"
typedef float32x4_t Vec;
static const int VL = 4;
static inline Vec vzero() { return vdupq_n_f32(0.0f); }
static inline Vec vload(const float* p) { return vld1q_f32(p); }
static inline void vstore(float* p, Vec v) { vst1q_f32(p, v); }
static inline Vec vset1(float x) { return vdupq_n_f32(x); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
#else
#define TG_SIMD "portable"
typedef float Vec;
static const int VL = 1;
static inline Vec vzero() { return 0.0f; }
static inline Vec vload(const float* p) { return *p; }
static inline void vstore(float* p, Vec v) { *p = v; }
static inline Vec vset1(float x) { return x; }
static inline Vec vfma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }
#endif

// Registers for the GEMM's accumulator tile: MR rows x (2 * VL) columns. AVX-512 and NEON
// have 32 vector registers (24 accumulators), AVX2 16 (12), the scalar build enough.
#if defined(__AVX512F__) || (defined(__ARM_NEON) && defined(__aarch64__))
static const int MR = 12;
#elif defined(__AVX2__)
static const int MR = 6;
#else
static const int MR = 4;
#endif
static const int NR = 2 * VL;
