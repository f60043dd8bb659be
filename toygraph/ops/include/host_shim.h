// The CUDA builtins for running toygraph's kernels on the CPU (cuda/host/compiler.py compiles the
// backend's module, every family's toygraph/ops/*/*.cu, as host C++ with this header in
// front and TG_HOST defined).
//
// Execution model: the blocks of a launch run one after another; inside a block every
// CUDA thread is a fiber (its own small stack) and the fibers run round-robin on the one
// OS thread until they finish or wait: __syncthreads waits for every thread of the block,
// a warp collective (__shfl_*_sync, __ballot_sync, mma.sync) for the 32 lanes of the warp.
// The last thread to arrive releases the others (and, for a collective, computes its
// result from what every lane deposited). A barrier that can never complete (threads
// exited or waiting elsewhere) fails the launch with a message instead of hanging; so
// does a partial-warp mask. Fibers run first to last, or last to first
// (tg_host_set_schedule): a kernel that gives different results has a race.
//
// __shared__ arrays become static arrays in the section "tg_shared": with blocks run one
// at a time they are per block, and the whole section is filled with 0xFF bytes (NaN as
// f32) before every block, so a kernel reading shared memory it did not write this block
// sees garbage, as it would on a GPU. Dynamic (extern) shared memory is not emulated.
// g++ leaves the static locals of a *template* function out of that section (they are
// plain per-process arrays, not refilled per block): kernels that want the per-block
// garbage, or ldmatrix / cp.async (which check their shared addresses against the
// section), declare their shared arrays in the extern "C" kernel and pass them down.
//
// Arithmetic: compiled with -ffp-contract=off, so __fadd_rn & co are single IEEE
// operations and fmaf is a true fused multiply-add, as on the GPU. expf/logf/pow/... are
// the C library's (the GPU's differ in the last ulps).
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <mutex>
#include <utility>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};
typedef uint3 dim3;
// CUDA's 16-byte vector type (the vectorised elementwise kernels' loads and stores).
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("tg_shared")))

namespace tg_host {

constexpr int MAX_THREADS = 1024, WARP = 32, MAX_WARPS = MAX_THREADS / WARP;
constexpr size_t STACK_BYTES = 256 * 1024;
enum State { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE };

// One cp.async a thread issued and has not waited for: `group` is the commit group it
// belongs to (-1 until cp.async.commit_group), `data` the source bytes read at issue.
struct AsyncCopy {
    char* dst;
    unsigned char data[16];
    int bytes, group;
};

struct Thread {
    void* sp;
    State state;
    uint3 idx;
    int warp, lane;
    std::vector<AsyncCopy> copies;   // pending cp.async (see "cp.async" below)
    int groups;                      // commit groups this thread has committed
};

// One warp's exchange: lanes deposit into `slot`, the releasing lane computes `out`.
struct Warp {
    int arrived;
    uint32_t slot[WARP][10];
    uint32_t out[WARP][4];
};

static Thread g_threads[MAX_THREADS];
static char* g_stacks[MAX_THREADS];
static Warp g_warps[MAX_WARPS];
static Thread* g_cur;
static void* g_sched_sp;
static uint3 g_block, g_bdim, g_gdim;
static int g_nthreads, g_block_arrived;
static void (*g_body)(void*);
static void* g_body_ctx;
static char g_error[1024];
static int g_reverse;   // run the fibers of a block last to first (tg_host_set_schedule)
static const char* g_kernel;
static std::mutex g_lock;

// ---- fibers: a minimal context switch (callee-saved registers + stack pointer) -------
#if defined(__x86_64__)
extern "C" void tg_fiber_swap(void** save_sp, void* new_sp);
extern "C" void tg_fiber_boot();
__asm__(R"(
    .text
    .globl tg_fiber_swap
    .hidden tg_fiber_swap
    .type tg_fiber_swap, @function
tg_fiber_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tg_fiber_swap, .-tg_fiber_swap
    .globl tg_fiber_boot
    .hidden tg_fiber_boot
    .type tg_fiber_boot, @function
tg_fiber_boot:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size tg_fiber_boot, .-tg_fiber_boot
)");

// A fresh stack whose first switch-in "returns" into tg_fiber_boot, which calls entry(arg).
static void* fiber_init(char* stack, void (*entry)(void*), void* arg) {
    uintptr_t top = ((uintptr_t)(stack + STACK_BYTES) & ~(uintptr_t)15) - 16;
    void** sp = (void**)(top - 56);   // 6 registers + return address; boot sees rsp % 16 == 0
    sp[0] = sp[1] = nullptr;          // r15, r14
    sp[2] = (void*)entry;             // r13
    sp[3] = arg;                      // r12
    sp[4] = sp[5] = nullptr;          // rbx, rbp
    sp[6] = (void*)&tg_fiber_boot;
    return sp;
}
static inline void fiber_swap(void** save, void* to) { tg_fiber_swap(save, to); }
#else
#error "the toygraph host executor's fibers are written for x86-64"
#endif

static char* stack_of(int t) {
    if (!g_stacks[t]) {   // a guard page below each stack turns an overflow into a fault
        void* p = mmap(nullptr, STACK_BYTES + 4096, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return nullptr;
        mprotect(p, 4096, PROT_NONE);
        g_stacks[t] = (char*)p + 4096;
    }
    return g_stacks[t];
}

// ---- scheduling ------------------------------------------------------------------------
static inline void yield_to_scheduler() { fiber_swap(&g_cur->sp, g_sched_sp); }

// Stop the launch from inside a kernel thread: the scheduler sees the message and returns.
[[noreturn]] static void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char* fmt, ...) {
    if (!g_error[0]) {
        int n = snprintf(g_error, sizeof g_error, "%s block (%u,%u,%u) thread (%u,%u,%u): ",
                         g_kernel, g_block.x, g_block.y, g_block.z, g_cur->idx.x, g_cur->idx.y,
                         g_cur->idx.z);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g_error + n, sizeof g_error - n, fmt, ap);
        va_end(ap);
    }
    g_cur->state = DONE;
    yield_to_scheduler();
    abort();   // never resumed
}

static void thread_main(void*) {
    g_body(g_body_ctx);
    if (!g_cur->copies.empty())
        fail("exited with %d cp.async copies it never waited for (cp.async.wait_group)",
             (int)g_cur->copies.size());
    g_cur->state = DONE;
    yield_to_scheduler();
}

static int lanes_in(int warp) {
    int n = g_nthreads - warp * WARP;
    return n < WARP ? n : WARP;
}

static void syncthreads() {
    if (++g_block_arrived == g_nthreads) {
        g_block_arrived = 0;
        for (int t = 0; t < g_nthreads; ++t)
            if (g_threads[t].state == WAIT_BLOCK) g_threads[t].state = RUNNABLE;
        return;
    }
    g_cur->state = WAIT_BLOCK;
    yield_to_scheduler();
}

// Deposit, wait for the whole warp; the last lane runs `release` on the full slots.
static Warp& warp_exchange(unsigned mask, void (*release)(Warp&)) {
    int w = g_cur->warp, lanes = lanes_in(w);
    unsigned full = lanes == WARP ? 0xffffffffu : ((1u << lanes) - 1u);
    if (mask != full) fail("warp collective with mask 0x%08x: only full warps are emulated", mask);
    Warp& W = g_warps[w];
    if (++W.arrived == lanes) {
        W.arrived = 0;
        release(W);
        for (int t = w * WARP; t < w * WARP + lanes; ++t)
            if (g_threads[t].state == WAIT_WARP) g_threads[t].state = RUNNABLE;
    } else {
        g_cur->state = WAIT_WARP;
        yield_to_scheduler();
    }
    return W;
}

static void copy_slots(Warp& W) {
    for (int l = 0; l < WARP; ++l) W.out[l][0] = W.slot[l][0];
}

static void ballot_release(Warp& W) {
    uint32_t bits = 0;
    for (int l = 0; l < WARP; ++l) bits |= (W.slot[l][0] ? 1u : 0u) << l;
    for (int l = 0; l < WARP; ++l) W.out[l][0] = bits;
}

// Lane `src` of the value every lane deposited (own value when src is outside the warp).
template <class T>
static T shuffle(unsigned mask, T v, int src) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    memcpy(&g_warps[g_cur->warp].slot[g_cur->lane][0], &v, 4);
    Warp& W = warp_exchange(mask, copy_slots);
    if (src < 0 || src >= lanes_in(g_cur->warp)) return v;
    T r;
    memcpy(&r, &W.out[src][0], 4);
    return r;
}

// ---- mma.sync: m16n8k16 bf16 and m16n8k8 tf32, f32 accumulate -------------------------
// Fragment layouts from the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating
// point type", "Matrix Fragments for mma.m16n8k8"), g = lane >> 2, t = lane % 4:
//   bf16 A a0..a7 (two per register, low half first): row g + 8*[i%4 >= 2],
//        col 2t + (i&1) + 8*[i >= 4];  B b0..b3: k 2t + (i&1) + 8*[i >= 2], n g.
//   tf32 A a0..a3: row g + 8*(i&1), col t + 4*[i >= 2];  B b0, b1: k t + 4*i, n g.
//   C/D c0..c3: row g + 8*[i >= 2], col 2t + (i&1).
// Products are exact in double; the K products and C are summed in double and rounded to
// f32 once (the hardware's internal order is unspecified; the difference is in the last
// bits of the f32 result).
static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

template <int K>
static void mma_release(Warp& W) {
    double A[16][K], B[K][8], C[16][8];
    for (int lane = 0; lane < WARP; ++lane) {
        const uint32_t* s = W.slot[lane];
        int g = lane >> 2, t = lane & 3;
        if constexpr (K == 16) {   // bf16: element i in register i / 2, low half first
            for (int i = 0; i < 8; ++i) {
                uint32_t h = (s[i / 2] >> (16 * (i & 1))) & 0xffffu;
                A[g + 8 * ((i % 4) >= 2)][2 * t + (i & 1) + 8 * (i >= 4)] = bits_float(h << 16);
            }
            for (int i = 0; i < 4; ++i) {
                uint32_t h = (s[4 + i / 2] >> (16 * (i & 1))) & 0xffffu;
                B[2 * t + (i & 1) + 8 * (i >= 2)][g] = bits_float(h << 16);
            }
        } else {                   // tf32: one element per register, low 13 bits not read
            for (int i = 0; i < 4; ++i)
                A[g + 8 * (i & 1)][t + 4 * (i >= 2)] = bits_float(s[i] & 0xffffe000u);
            for (int i = 0; i < 2; ++i) B[t + 4 * i][g] = bits_float(s[4 + i] & 0xffffe000u);
        }
        for (int i = 0; i < 4; ++i) C[g + 8 * (i >= 2)][2 * t + (i & 1)] = bits_float(s[6 + i]);
    }
    for (int lane = 0; lane < WARP; ++lane) {
        int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; ++i) {
            int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
            double d = C[row][col];
            for (int k = 0; k < K; ++k) d += A[row][k] * B[k][col];
            float f = (float)d;
            memcpy(&W.out[lane][i], &f, 4);
        }
    }
}

template <int K>
static void mma(float* c, const unsigned* a, const unsigned* b) {
    uint32_t* s = g_warps[g_cur->warp].slot[g_cur->lane];
    memcpy(s, a, 16);
    memcpy(s + 4, b, 8);
    memcpy(s + 6, c, 16);
    Warp& W = warp_exchange(0xffffffffu, mma_release<K>);
    memcpy(c, W.out[g_cur->lane], 16);
}

// ---- ldmatrix and cp.async (sm_80+) ----------------------------------------------------
extern "C" char __start_tg_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_tg_shared[] __attribute__((weak, visibility("hidden")));

static bool in_shared(const void* p, int bytes) {
    const char* c = (const char*)p;
    return __start_tg_shared && c >= __start_tg_shared && c + bytes <= __stop_tg_shared;
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16 (PTX ISA, "Warp-level matrix load
// instruction: ldmatrix"): NM 8 x 8 matrices of 16-bit elements; lanes 8i .. 8i+7 give the
// (16-byte aligned, shared) addresses of rows 0..7 of matrix i. Register i of lane l holds
// matrix i's row l / 4, elements 2(l % 4) and 2(l % 4) + 1 (low half first); with .trans
// the transposed matrix's, i.e. elements (2(l % 4), l / 4) and (2(l % 4) + 1, l / 4).
// Lanes not giving an address (8 NM .. 31) still take part and still receive registers.
template <int NM, bool TRANS>
static void ldmatrix_release(Warp& W) {
    uint16_t M[4][8][8];
    for (int i = 0; i < NM; ++i)
        for (int r = 0; r < 8; ++r) {
            const char* row;
            memcpy(&row, W.slot[8 * i + r], sizeof row);
            memcpy(M[i][r], row, 16);
        }
    for (int l = 0; l < WARP; ++l) {
        int g = l >> 2, t = l & 3;
        for (int i = 0; i < NM; ++i) {
            uint16_t lo = TRANS ? M[i][2 * t][g] : M[i][g][2 * t];
            uint16_t hi = TRANS ? M[i][2 * t + 1][g] : M[i][g][2 * t + 1];
            W.out[l][i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
}

template <int NM, bool TRANS>
static void ldmatrix(unsigned* d, const void* row) {
    static_assert(NM == 1 || NM == 2 || NM == 4, "ldmatrix: .x1, .x2 or .x4");
    if (g_cur->lane < 8 * NM) {
        if ((uintptr_t)row % 16) fail("ldmatrix: row address %p is not 16-byte aligned", row);
        if (!in_shared(row, 16)) fail("ldmatrix: row address %p is not in shared memory", row);
    }
    memcpy(g_warps[g_cur->warp].slot[g_cur->lane], &row, sizeof row);
    Warp& W = warp_exchange(0xffffffffu, ldmatrix_release<NM, TRANS>);
    memcpy(d, W.out[g_cur->lane], 4 * NM);
}

// cp.async.{ca,cg}.shared.global [dst], [src], bytes, src_bytes (PTX ISA, "cp.async"):
// copies `bytes` (4, 8 or 16; .cg 16 only) from global to shared memory, asynchronously;
// the source bytes past src_bytes read as zeros. cp.async.commit_group closes the thread's
// pending copies into a group, cp.async.wait_group N waits until at most the N most recent
// groups are pending. The data is only defined after that wait (and a barrier, for other
// threads). Emulation: the source is read at issue (it must not change before the wait on
// a GPU either), the destination is poisoned with 0xFF bytes (NaN as f32 or bf16) at
// issue and written only when a wait_group completes the copy's group -- so a kernel that
// reads a tile before waiting for it, waits for too few groups, or still reads the old
// contents of a buffer it is refilling sees NaN here, as it could see stale data on a
// GPU. A thread that exits with copies it never waited for fails the launch.
static void cp_async(void* dst, const void* src, int bytes, int src_bytes, bool cg) {
    if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async: size %d (4, 8 or 16)", bytes);
    if (cg && bytes != 16) fail("cp.async.cg: size %d (16 only)", bytes);
    if (src_bytes < 0 || src_bytes > bytes) fail("cp.async: src-size %d of %d", src_bytes, bytes);
    if ((uintptr_t)dst % bytes || (uintptr_t)src % bytes)
        fail("cp.async: %p <- %p not aligned to %d bytes", dst, src, bytes);
    if (!in_shared(dst, bytes)) fail("cp.async: destination %p is not in shared memory", dst);
    AsyncCopy c;
    c.dst = (char*)dst;
    c.bytes = bytes;
    c.group = -1;
    memset(c.data, 0, sizeof c.data);
    if (src_bytes > 0) memcpy(c.data, src, src_bytes);
    memset(dst, 0xff, bytes);
    g_cur->copies.push_back(c);
}

static void cp_async_commit() {
    for (AsyncCopy& c : g_cur->copies)
        if (c.group < 0) c.group = g_cur->groups;
    ++g_cur->groups;
}

// Completes the copies of every committed group but the n most recent.
static void cp_async_wait(int n) {
    std::vector<AsyncCopy>& cs = g_cur->copies;
    size_t keep = 0;
    for (size_t i = 0; i < cs.size(); ++i) {
        if (cs[i].group >= 0 && cs[i].group < g_cur->groups - n)
            memcpy(cs[i].dst, cs[i].data, cs[i].bytes);
        else
            cs[keep++] = cs[i];
    }
    cs.resize(keep);
}

// ---- cvt roundings ----------------------------------------------------------------------
static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// cvt.rn.bf16.f32: round to nearest, ties to even; NaN -> canonical NaN.
static inline unsigned short cvt_rn_bf16(float x) {
    uint32_t u = float_bits(x);
    if (isnan(x)) return 0x7fff;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// cvt.rna.tf32.f32: round to nearest, ties away from zero, 10 mantissa bits kept.
static inline unsigned cvt_rna_tf32(float x) {
    if (isnan(x)) return 0x7fffffffu;
    uint32_t u = float_bits(x);
    if (isinf(x)) return u;
    return (u + 0x1000u) & 0xffffe000u;
}

// cvt.f32.f16: exact IEEE half -> float.
static inline float half_to_float(unsigned short h) {
    unsigned e = (h >> 10) & 31, m = h & 1023;
    float f = e == 0 ? ldexpf((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), (int)e - 25);
    return (h >> 15) ? -f : f;
}

// ---- one launch -------------------------------------------------------------------------

// Runs every thread of the current block to completion; false on a failure or deadlock.
static bool run_block() {
    if (__start_tg_shared) memset(__start_tg_shared, 0xff, __stop_tg_shared - __start_tg_shared);
    g_block_arrived = 0;
    for (int w = 0; w < (g_nthreads + WARP - 1) / WARP; ++w) g_warps[w].arrived = 0;
    for (int t = 0; t < g_nthreads; ++t) {
        Thread& th = g_threads[t];
        th.state = RUNNABLE;
        th.idx = {(unsigned)(t % g_bdim.x), (unsigned)(t / g_bdim.x % g_bdim.y),
                  (unsigned)(t / (g_bdim.x * g_bdim.y))};
        th.warp = t / WARP;
        th.lane = t % WARP;
        th.copies.clear();
        th.groups = 0;
        th.sp = fiber_init(g_stacks[t], thread_main, nullptr);
    }
    int done = 0;
    while (done < g_nthreads) {
        bool progress = false;
        done = 0;
        for (int i = 0; i < g_nthreads; ++i) {
            Thread& th = g_threads[g_reverse ? g_nthreads - 1 - i : i];
            if (th.state == RUNNABLE) {
                g_cur = &th;
                fiber_swap(&g_sched_sp, th.sp);
                progress = true;
                if (g_error[0]) return false;
            }
            done += th.state == DONE;
        }
        if (!progress && done < g_nthreads) {
            int wb = 0, ww = 0;
            for (int t = 0; t < g_nthreads; ++t) {
                wb += g_threads[t].state == WAIT_BLOCK;
                ww += g_threads[t].state == WAIT_WARP;
            }
            snprintf(g_error, sizeof g_error,
                     "%s block (%u,%u,%u): deadlock: %d of %d threads wait at __syncthreads, "
                     "%d at a warp collective, %d exited",
                     g_kernel, g_block.x, g_block.y, g_block.z, wb, g_nthreads, ww, done);
            return false;
        }
    }
    return true;
}

// dims: grid x, y, z, block x, y, z. Returns 0, or 1 with the message in g_error.
static int run_grid(const char* kernel, void (*body)(void*), void* ctx, const int* dims,
                    int shmem) {
    std::lock_guard<std::mutex> hold(g_lock);
    g_error[0] = 0;
    g_kernel = kernel;
    long long nthreads = (long long)dims[3] * dims[4] * dims[5];
    bool bad = false;
    for (int i = 0; i < 6; ++i) bad |= dims[i] < 1;
    if (bad || nthreads > MAX_THREADS || dims[1] > 65535 || dims[2] > 65535 || dims[5] > 64) {
        snprintf(g_error, sizeof g_error, "%s: invalid launch grid (%d,%d,%d) block (%d,%d,%d)",
                 kernel, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]);
        return 1;
    }
    if (shmem != 0) {
        snprintf(g_error, sizeof g_error, "%s: %d bytes of dynamic shared memory requested; "
                 "the host executor does not emulate extern __shared__", kernel, shmem);
        return 1;
    }
    g_nthreads = (int)nthreads;
    for (int t = 0; t < g_nthreads; ++t)
        if (!stack_of(t)) {
            snprintf(g_error, sizeof g_error, "%s: out of memory for thread stacks", kernel);
            return 1;
        }
    g_body = body;
    g_body_ctx = ctx;
    g_gdim = {(unsigned)dims[0], (unsigned)dims[1], (unsigned)dims[2]};
    g_bdim = {(unsigned)dims[3], (unsigned)dims[4], (unsigned)dims[5]};
    for (unsigned z = 0; z < g_gdim.z; ++z)
        for (unsigned y = 0; y < g_gdim.y; ++y)
            for (unsigned x = 0; x < g_gdim.x; ++x) {
                g_block = {x, y, z};
                if (!run_block()) return 1;
            }
    return 0;
}

// Calls kernel f with its arguments read from params[i] (the address of argument i).
template <class... A>
struct Call {
    void (*f)(A...);
    void** params;
    template <size_t... I>
    void invoke(std::index_sequence<I...>) { f(*static_cast<A*>(params[I])...); }
    static void run(void* self) {
        static_cast<Call*>(self)->invoke(std::index_sequence_for<A...>{});
    }
};

template <class... A>
static int launch(const char* name, void (*f)(A...), const int* dims, int shmem,
                  void** params) {
    Call<A...> call{f, params};
    return run_grid(name, &Call<A...>::run, &call, dims, shmem);
}

}  // namespace tg_host

extern "C" __attribute__((visibility("default"))) const char* tg_host_error() {
    return tg_host::g_error;
}

// The order fibers run in between barriers: a kernel whose result depends on it has a
// race (a thread reading shared memory another writes without a barrier between).
extern "C" __attribute__((visibility("default"))) void tg_host_set_schedule(int reverse) {
    tg_host::g_reverse = reverse;
}

// One exported entry per kernel (compiler.py appends these for every kernel it finds).
#define TG_HOST_EXPORT(name)                                                              \
    extern "C" __attribute__((visibility("default"))) int tg_host_launch_##name(          \
        const int* dims, int shmem, void** params) {                                      \
        return tg_host::launch(#name, name, dims, shmem, params);                         \
    }

// ---- the builtins the kernels use -------------------------------------------------------
#define threadIdx (tg_host::g_cur->idx)
#define blockIdx (tg_host::g_block)
#define blockDim (tg_host::g_bdim)
#define gridDim (tg_host::g_gdim)
#define warpSize 32

static inline void __syncthreads() { tg_host::syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    tg_host::warp_exchange(mask, tg_host::copy_slots);
}

template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    int lane = tg_host::g_cur->lane;
    return tg_host::shuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    int lane = tg_host::g_cur->lane, src = lane ^ m;
    return tg_host::shuffle(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = tg_host::g_cur->lane;
    return tg_host::shuffle(mask, v, (lane & (width - 1)) + (int)d < width ? lane + (int)d : lane);
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = tg_host::g_cur->lane;
    return tg_host::shuffle(mask, v, (lane & (width - 1)) >= (int)d ? lane - (int)d : lane);
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    tg_host::g_warps[tg_host::g_cur->warp].slot[tg_host::g_cur->lane][0] = pred != 0;
    return tg_host::warp_exchange(mask, tg_host::ballot_release).out[tg_host::g_cur->lane][0];
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }

// Atomics: fibers switch only at barriers, so a plain read-modify-write is atomic here.
template <class T>
static inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T>
static inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T>
static inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T>
static inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T>
static inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }

// Explicitly rounded arithmetic (single IEEE operations: no contraction with fp-contract=off).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __fdividef(float a, float b) { return a / b; }
// (__expf and __logf need nothing: glibc's math.h declares them, as expf and logf.)
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __half2float(unsigned short h) { return tg_host::half_to_float(h); }
static inline float __bfloat162float(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
static inline unsigned short __float2bfloat16_rn(float x) { return tg_host::cvt_rn_bf16(x); }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
