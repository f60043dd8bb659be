// The CPU engine's entry points (ctypes, engine.py): the pool's size, whole-tensor decodes,
// the products on blocks (products.h), and the replay of a plan (replay.h). Assembled by
// engine.py after the layout macros of blocks.c_defines() and the headers simd.h, pool.h,
// decode.h, gemm.h, dot.h, dot8.h, replay.h, vmath.h, products.h and the op families'
// cpu.h kernels, in that order.

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

// c = a . W^T or a . W with W in its blocks: products.h's gemm_on_blocks says how.
TG_EXPORT int tg_matmul(int fmt, const u8* w, int64_t row_bytes, int64_t N, int64_t K,
                        const float* a, int64_t lda, int64_t M, float* c, int64_t ldc,
                        int transposed, int kernel) {
    return gemm_on_blocks(fmt, w, row_bytes, N, K, a, lda, M, c, ldc, transposed, kernel);
}

// numpy's ``rng.choice(n, p=p)`` given its one uniform draw ``u`` (inference/sampling.py's
// draw): the first i whose cumulative sum over p's total exceeds u, each sum the previous
// plus p[i] as numpy's cumsum adds them (one at a time, in order: the same bits), so the
// same index as ``searchsorted(cumsum(p) / total, u, side="right")``. Two passes, nothing
// stored: 6x faster than numpy's cumsum over a 151,936-token vocabulary. Returns -1 where
// the total is not finite (a NaN in p), as choice refuses it.
TG_EXPORT int64_t tg_draw(const double* p, int64_t n, double u) {
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total += p[i];
    if (!std::isfinite(total)) return -1;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        sum += p[i];
        if (sum / total > u) return i;
    }
    return n;
}

// Free the memory the kernels keep between calls on this thread (replay.h's
// KeptRegistration): a training run calls it when it is over.
TG_EXPORT void tg_release() {
    for (void (*release)() : kept_memory()) release();
}

// The index of the replay kernel named ``name`` (replay.h's table), or -1.
TG_EXPORT int tg_replay_kernel(const char* name) {
    const std::vector<ReplayKernel>& table = replay_kernels();
    for (size_t k = 0; k < table.size(); k++)
        if (strcmp(table[k].name, name) == 0) return (int)k;
    return -1;
}

// Run ``count`` nodes of a plan in order (replay.h). Returns 0, or stops at the first node
// whose kernel fails: its index goes to *failed and its code is returned (-1: a kernel
// index out of the table). With ``ns`` (else null) each node's wall time in nanoseconds is
// written there (the op profile).
TG_EXPORT int tg_replay(const ReplayNode* nodes, int64_t count, int64_t* failed, int64_t* ns) {
    const std::vector<ReplayKernel>& table = replay_kernels();
    for (int64_t k = 0; k < count; k++) {
        const int32_t id = nodes[k].kernel;
        const auto t0 = std::chrono::steady_clock::now();
        const int rc = id >= 0 && (size_t)id < table.size() ? table[id].fn(nodes[k]) : -1;
        if (ns)
            ns[k] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - t0).count();
        if (rc != 0) {
            *failed = k;
            return rc;
        }
    }
    return 0;
}
