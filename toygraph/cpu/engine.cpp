// The CPU engine's entry points (ctypes, engine.py): the pool's size, whole-tensor decodes
// and the products on blocks of gemm.h and dot.h. Assembled by engine.py after the layout macros of
// blocks.c_defines() and the headers simd.h, pool.h, decode.h, gemm.h, dot.h, dot8.h, in that order.

#define TG_EXPORT extern "C" __attribute__((visibility("default")))

TG_EXPORT const char* tg_simd() { return TG_SIMD; }

// 1 where the 8-bit dot kernels are built (dot8.h: x86 with AVX2, ARM with NEON), else 0.
TG_EXPORT int tg_dot_q8() {
#if defined(TG_DOT_Q8)
    return 1;
#else
    return 0;
#endif
}

// A 64-bit count (ctypes once wrapped 2^32 + 1 to 1), bounded by pool.h's kMaxThreads.
TG_EXPORT int tg_set_threads(int64_t n) { return pool_set_threads(n); }

TG_EXPORT int tg_threads() { return pool_threads(); }

// Decode ``nblocks`` blocks of format ``fmt`` (an index of engine.py's FORMATS) from ``raw``
// into ``out`` (nblocks * qk floats) on the pool. Returns 0, or -1 for an unknown format.
TG_EXPORT int tg_decode(int fmt, const u8* raw, float* out, int64_t nblocks) {
    if (fmt < 0 || fmt >= kNumFormats) return -1;
    const Format& f = kFormats[fmt];
    const int64_t per = (int64_t)(1 << 14) / f.qk;   // 16k elements (64 KiB out) a task
    pool_for((nblocks + per - 1) / per, [&](int64_t task, int) {
        const int64_t first = task * per, n = nblocks - first < per ? nblocks - first : per;
        f.run(raw + first * f.bytes, out + first * f.qk, n);
    });
    return 0;
}

// Rows ``ids`` (n of them) of a [rows, K] tensor into out [n, K] (an embedding lookup).
TG_EXPORT int tg_decode_rows(int fmt, const u8* raw, int64_t row_bytes, int64_t K,
                             const int32_t* ids, int64_t n, float* out) {
    if (fmt < 0 || fmt >= kNumFormats) return -1;
    const Format& f = kFormats[fmt];
    pool_for((n + 15) / 16, [&](int64_t task, int) {
        for (int64_t i = task * 16; i < n && i < task * 16 + 16; i++)
            decode_row_part(f, raw + (int64_t)ids[i] * row_bytes, 0, K, out + i * K);
    });
    return 0;
}

// c = a . W^T (transposed = 1: c [M, N], a [M, K]) or c = a . W (transposed = 0: c [M, K],
// a [M, N]), W [N, K] in format ``fmt`` with rows row_bytes apart. ``kernel``: 0 picks by
// shape (a few rows: the 8-bit dot kernels where built for the format, else the f32 ones),
// 1 the panel GEMM, 2 the f32 row-dot kernels, 3 the 8-bit ones (transposed only). Returns
// 0, -1 (bad arguments) or -2 (no 8-bit kernel for this format, shape or CPU).
TG_EXPORT int tg_matmul(int fmt, const u8* w, int64_t row_bytes, int64_t N, int64_t K,
                        const float* a, int64_t lda, int64_t M, float* c, int64_t ldc,
                        int transposed, int kernel) {
    if (fmt < 0 || fmt >= kNumFormats || M < 0 || N < 0 || K < 0) return -1;
    Product p{&kFormats[fmt], w, row_bytes, N, K, a, lda, M, c, ldc, 0, 1};
    if (M == 0 || N == 0) return 0;
    if (!transposed) {
        if (kernel >= 2) return -1;
        matmul_nn(p);
    } else if (kernel == 3) {
        if (!matmul_dot_q8(p)) return -2;
    } else if (kernel == 0 && M <= DOT_MAX_M) {
        if (!matmul_dot_q8(p)) matmul_dot(p);
    } else if (kernel == 2) {
        matmul_dot(p);
    } else {
        matmul_nt(p);
    }
    return 0;
}
