// The experts family's replay kernels (replay.h): the router's topk, take_along and its
// backward put_along, group_by_expert, and the grouped products expert_matmul (weights in
// f32 or kept in their GGUF blocks) and expert_matmul_dw.
//
// routes ([E + 1 + R] i32, R = N * k slots) are the offsets of each expert's group, then
// the slots ordered by expert and, within one, by slot (__init__.py). The products gather
// the rows their slots read into one [R, width] array in that order, so expert e's rows
// are one run of it (rows off[e]..off[e + 1]), multiply each run as one GEMM, and scatter
// the rows back to the slots. Every element of a result is one chain of sums whose order
// is fixed by the routes and the shapes, never by the threads.
//
// The f32 GEMM here is its own loop over gemm.h's micro-kernel (rows_times_panel), packing
// W[e]^T along W's rows; the products on blocks are cpu/products.h's gemm_on_blocks.

#include <sys/mman.h>
#include <unistd.h>

// Codes a kernel returns for operands it cannot take (replay.py names the node).
static const int kMoeBadIds = -3;      // an id outside [0, E)
static const int kMoeBadRoutes = -4;   // offsets or slots that are not a grouping of R slots

// --- the router --------------------------------------------------------------------------------

// Whether value v (at a later index) is placed before u (at an earlier one) in numpy's
// stable argsort of -x: only when strictly larger. NaN sorts last (numpy puts NaN at the
// end, and -NaN is NaN), in index order among NaNs.
static inline bool topk_before(float v, float u) {
    return !std::isnan(v) && (std::isnan(u) || v > u);
}

// out [rows, k] (i32) = the indices of the k largest of each row of x [rows, E], largest
// first, ties to the lower index: numpy's argsort(-x, kind="stable")[..., :k] exactly. An
// insertion into the row's sorted top k: O(E k), and k is a handful.
// p: out, x; i: rows, E, k.
TG_REPLAY_KERNEL(topk) {
    int32_t* out = (int32_t*)n.p[0];
    const float* x = (const float*)n.p[1];
    const int64_t E = n.i[1], k = n.i[2];
    if (k < 1 || k > E) return -1;
    replay_for(n.i[0], E, [&](int64_t r0, int64_t r1) {
        float* top = replay_scratch((size_t)k);
        for (int64_t r = r0; r < r1; r++) {
            const float* row = x + r * E;
            int32_t* ids = out + r * k;
            int64_t filled = 0;
            for (int64_t e = 0; e < E; e++) {
                int64_t at = filled;
                while (at > 0 && topk_before(row[e], top[at - 1])) at--;
                if (at >= k) continue;
                const int64_t last = filled < k ? filled : k - 1;
                for (int64_t s = last; s > at; s--) {
                    top[s] = top[s - 1];
                    ids[s] = ids[s - 1];
                }
                top[at] = row[e];
                ids[at] = (int32_t)e;
                if (filled < k) filled++;
            }
        }
    });
    return 0;
}

// An id of a row of width E as numpy indexes with it (a negative one counts from the
// end), or -1 when it is outside the row.
static inline int64_t moe_index(int32_t id, int64_t E) {
    const int64_t i = id < 0 ? (int64_t)id + E : (int64_t)id;
    return i >= 0 && i < E ? i : -1;
}

// Whether every one of ``count`` ids indexes a row of width E (as moe_index takes it).
static bool moe_ids_valid(const int32_t* ids, int64_t count, int64_t E) {
    for (int64_t s = 0; s < count; s++)
        if (moe_index(ids[s], E) < 0) return false;
    return true;
}

// out [rows, k] = x [rows, E] at each row's ids [rows, k]. p: out, x, ids; i: rows, E, k.
TG_REPLAY_KERNEL(take_along) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    const int32_t* ids = (const int32_t*)n.p[2];
    const int64_t rows = n.i[0], E = n.i[1], k = n.i[2];
    if (!moe_ids_valid(ids, rows * k, E)) return kMoeBadIds;
    replay_for(rows, k, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++)
            for (int64_t j = 0; j < k; j++) out[r * k + j] = x[r * E + moe_index(ids[r * k + j], E)];
    });
    return 0;
}

// take_along's backward: out [rows, width] = 0, then g [rows, k] added at each row's ids,
// in j order (numpy's np.add.at: a repeated id sums its terms in that order).
// p: out, g, ids; i: rows, width, k.
TG_REPLAY_KERNEL(put_along) {
    float* out = (float*)n.p[0];
    const float* g = (const float*)n.p[1];
    const int32_t* ids = (const int32_t*)n.p[2];
    const int64_t rows = n.i[0], width = n.i[1], k = n.i[2];
    if (!moe_ids_valid(ids, rows * k, width)) return kMoeBadIds;
    replay_for(rows, width, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            float* o = out + r * width;
            for (int64_t c = 0; c < width; c++) o[c] = 0.0f;
            for (int64_t j = 0; j < k; j++) o[moe_index(ids[r * k + j], width)] += g[r * k + j];
        }
    });
    return 0;
}

// routes [E + 1 + R] from ids [R] (flat [N, k]): a counting sort, which is numpy's stable
// argsort of the ids. Tasks count their runs of slots per expert; the offsets of (expert,
// task) follow in expert-then-task order on the calling thread; each task then places its
// slots in order from its own offsets, so the order is the serial one.
// p: out, ids; i: R, E.
TG_REPLAY_KERNEL(group_by_expert) {
    int32_t* out = (int32_t*)n.p[0];
    const int32_t* ids = (const int32_t*)n.p[1];
    const int64_t R = n.i[0], E = n.i[1];
    for (int64_t s = 0; s < R; s++)
        if (ids[s] < 0 || ids[s] >= E) return kMoeBadIds;
    const int64_t per = kReplayGrain, tasks = R > 0 ? (R + per - 1) / per : 0;
    std::vector<int64_t> at((size_t)(tasks * E), 0);   // [task][expert]: counts, then starts
    pool_for(tasks, [&](int64_t t, int) {
        for (int64_t s = t * per; s < R && s < (t + 1) * per; s++) at[t * E + ids[s]]++;
    });
    int64_t total = 0;
    out[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t count = at[t * E + e];
            at[t * E + e] = total;
            total += count;
        }
        out[e + 1] = (int32_t)total;
    }
    int32_t* perm = out + E + 1;
    pool_for(tasks, [&](int64_t t, int) {
        for (int64_t s = t * per; s < R && s < (t + 1) * per; s++)
            perm[at[t * E + ids[s]]++] = (int32_t)s;
    });
    return 0;
}

// --- the grouped products ----------------------------------------------------------------------

// The routes of R slots over E experts, checked: offsets from 0 to R, never decreasing,
// and slots in [0, R). Returns false for anything else (the kernel refuses it).
struct Routes {
    const int32_t* off;    // [E + 1]
    const int32_t* perm;   // [R]
    int64_t E, R;

    bool valid() const {
        if (off[0] != 0 || off[E] != R) return false;
        for (int64_t e = 0; e < E; e++)
            if (off[e + 1] < off[e]) return false;
        for (int64_t r = 0; r < R; r++)
            if (perm[r] < 0 || perm[r] >= R) return false;
        return true;
    }
    int64_t rows(int64_t e) const { return off[e + 1] - off[e]; }
};

static Routes routes_of(const void* p, int64_t E, int64_t R) {
    const int32_t* r = (const int32_t*)p;
    return Routes{r, r + E + 1, E, R};
}

// The row of x a slot reads: its token's row (x [N, n_in], every slot of token n reads
// row n) or its own (x [N, k, n_in]).
static inline int64_t moe_source(int64_t slot, int64_t k, bool per_slot) {
    return per_slot ? slot : slot / k;
}

// rows [R, width]: row r = x's row of slot perm[r], in routes order.
static void moe_gather(const Routes& rt, const float* x, int64_t width, int64_t k, bool per_slot,
                       float* rows) {
    replay_for(rt.R, width, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++)
            memcpy(rows + r * width, x + moe_source(rt.perm[r], k, per_slot) * width,
                   (size_t)width * 4);
    });
}

// out [R, width]: the row of slot perm[r] = rows' row r.
static void moe_scatter(const Routes& rt, const float* rows, int64_t width, float* out) {
    replay_for(rt.R, width, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++)
            memcpy(out + (int64_t)rt.perm[r] * width, rows + r * width, (size_t)width * 4);
    });
}

// One GEMM of a group: C [M, N] = A [M, K] . B [K, N], A's rows lda apart (unit column
// stride), B(k, j) = b[k bk + j bn], C's rows ldc apart.
struct MoeGemm {
    const float* a;
    int64_t lda;
    const float* b;
    int64_t bk, bn;
    float* c;
    int64_t ldc, M, K, N;
};

// k is summed in runs of this many, each run one fused multiply-add chain, the runs' sums
// added in order (as cpu/products.h's gemm_f32: a long K rounds like BLAS's blocked sums).
static const int64_t kMoeRun = 256;

// Rows m0..m1 and columns n0..n0 + NR (or to N) of one group's C: B's strip packed as a
// [K][NR] panel, then the micro-kernel over the rows, run by run of k.
static void moe_gemm_tile(const MoeGemm& g, int64_t m0, int64_t m1, int64_t n0) {
    const int cols = (int)(g.N - n0 < NR ? g.N - n0 : NR);
    const int64_t rows = m1 - m0;
    float* panel = replay_scratch((size_t)(g.K * NR + rows * NR));
    float* part = panel + g.K * NR;   // one run of k's sums, [rows][NR]
    // B read along its unit stride: a row of k at a time (W[e] [n_in, n_out]), or by
    // tiles of 64 k a column at a time (W[e]^T: its columns are W[e]'s rows, often a
    // power of two apart, and one k of NR such rows at a time would map every load to one
    // cache set).
    for (int64_t k = 0; k < g.K; k++)
        for (int j = cols; j < NR; j++) panel[k * NR + j] = 0.0f;
    if (g.bn == 1) {
        for (int64_t k = 0; k < g.K; k++)
            memcpy(panel + k * NR, g.b + k * g.bk + n0, (size_t)cols * 4);
    } else {
        for (int64_t k0 = 0; k0 < g.K; k0 += 64) {
            const int64_t k1 = k0 + 64 < g.K ? k0 + 64 : g.K;
            for (int j = 0; j < cols; j++) {
                const float* src = g.b + (n0 + j) * g.bn;
                for (int64_t k = k0; k < k1; k++) panel[k * NR + j] = src[k * g.bk];
            }
        }
    }
    float* tile = g.c + m0 * g.ldc + n0;
    const float* a = g.a + m0 * g.lda;
    if (g.K == 0)
        for (int64_t m = 0; m < rows; m++)
            for (int j = 0; j < cols; j++) tile[m * g.ldc + j] = 0.0f;
    for (int64_t k0 = 0; k0 < g.K; k0 += kMoeRun) {
        const int64_t kk = g.K - k0 < kMoeRun ? g.K - k0 : kMoeRun;
        if (k0 == 0) {
            rows_times_panel(rows, kk, a, g.lda, panel, NR, tile, g.ldc, true, cols);
            continue;
        }
        rows_times_panel(rows, kk, a + k0, g.lda, panel + k0 * NR, NR, part, NR, true, NR);
        for (int64_t m = 0; m < rows; m++)
            for (int j = 0; j < cols; j++) tile[m * g.ldc + j] += part[m * NR + j];
    }
}

// Every group's GEMM on the pool at once: a task is one group's run of rows (whole
// micro-kernel tiles, about 64 rows) and strip of NR columns, so many small experts
// spread over the threads as well as one large one does.
static void moe_gemms(const std::vector<MoeGemm>& groups) {
    struct Tile { int64_t group, m0, m1, n0; };
    std::vector<Tile> tiles;
    const int64_t run = (64 + MR - 1) / MR * MR;
    for (int64_t e = 0; e < (int64_t)groups.size(); e++) {
        const MoeGemm& g = groups[e];
        for (int64_t m0 = 0; m0 < g.M; m0 += run)
            for (int64_t n0 = 0; n0 < g.N; n0 += NR)
                tiles.push_back({e, m0, m0 + run < g.M ? m0 + run : g.M, n0});
    }
    pool_for((int64_t)tiles.size(), [&](int64_t t, int) {
        const Tile& tile = tiles[t];
        moe_gemm_tile(groups[tile.group], tile.m0, tile.m1, tile.n0);
    });
}

// The operands every expert_matmul kernel reads: i: N, k, n_in, n_out, E, trans_b,
// per_slot (x [N, k, n_in]); p: out [N, k, n_out], x, w (or its bytes), routes.
struct ExpertProduct {
    float* out;
    const float* x;
    Routes rt;
    int64_t N, k, n_in, n_out, E;
    bool trans_b, per_slot;
};

static ExpertProduct expert_product_of(const ReplayNode& n) {
    ExpertProduct p;
    p.out = (float*)n.p[0];
    p.x = (const float*)n.p[1];
    p.N = n.i[0]; p.k = n.i[1]; p.n_in = n.i[2]; p.n_out = n.i[3]; p.E = n.i[4];
    p.trans_b = n.i[5] != 0;
    p.per_slot = n.i[6] != 0;
    p.rt = routes_of(n.p[3], p.E, p.N * p.k);
    return p;
}

// Per slot (n, j): out[n, j] = x's row . W[e]^T (trans_b, W [E, n_out, n_in]) or . W[e]
// (W [E, n_in, n_out]), e the slot's expert; experts no slot chose are never read.
// p: out, x, w, routes; i: N, k, n_in, n_out, E, trans_b, per_slot.
TG_REPLAY_KERNEL(expert_matmul) {
    const ExpertProduct p = expert_product_of(n);
    const float* w = (const float*)n.p[2];
    if (!p.rt.valid()) return kMoeBadRoutes;
    std::vector<float> xs((size_t)(p.rt.R * p.n_in)), ys((size_t)(p.rt.R * p.n_out));
    moe_gather(p.rt, p.x, p.n_in, p.k, p.per_slot, xs.data());
    std::vector<MoeGemm> groups;
    for (int64_t e = 0; e < p.E; e++) {
        if (p.rt.rows(e) == 0) continue;
        const int64_t r0 = p.rt.off[e];
        const float* we = w + e * p.n_in * p.n_out;
        groups.push_back({xs.data() + r0 * p.n_in, p.n_in, we, p.trans_b ? 1 : p.n_out,
                          p.trans_b ? p.n_in : 1, ys.data() + r0 * p.n_out, p.n_out,
                          p.rt.rows(e), p.n_in, p.n_out});
    }
    moe_gemms(groups);
    moe_scatter(p.rt, ys.data(), p.n_out, p.out);
    return 0;
}

// Ask the kernel to start reading an expert's bytes now (its pages of a mapped GGUF may
// not be in memory; the numpy backend's block kernel does the same through
// BlockTensor.prefetch). Best effort.
static void moe_prefetch(const u8* p, int64_t bytes) {
#if defined(MADV_WILLNEED)
    const int64_t page = (int64_t)sysconf(_SC_PAGESIZE);
    if (page <= 0 || bytes <= 0) return;
    const uintptr_t start = (uintptr_t)p - (uintptr_t)p % (uintptr_t)page;
    madvise((void*)start, (size_t)((uintptr_t)p + (uintptr_t)bytes - start), MADV_WILLNEED);
#else
    (void)p;
    (void)bytes;
#endif
}

// expert_matmul with W kept in its GGUF blocks: expert e's rows are its own run of bytes
// (expert_bytes each, rows of row_bytes), multiplied on the blocks by gemm_on_blocks
// without an f32 copy: W[e] [n_out, n_in] (trans_b) or [n_in, n_out], decoded panel by
// panel inside the product. Only the chosen experts' bytes are read. The products are the
// f32 ones (the panels, or the f32 row-dots for a few rows), never the 8-bit dot kernels:
// the numpy block kernel multiplies the decoded expert in f32. The experts run one after
// another, each on the whole pool.
// p: out, x, W's bytes, routes; i: N, k, n_in, n_out, E, trans_b, per_slot, fmt,
// row_bytes, expert_bytes.
TG_REPLAY_KERNEL(expert_matmul_blocks) {
    const ExpertProduct p = expert_product_of(n);
    const u8* w = (const u8*)n.p[2];
    const int fmt = (int)n.i[7];
    const int64_t row_bytes = n.i[8], expert_bytes = n.i[9];
    if (!p.rt.valid()) return kMoeBadRoutes;
    std::vector<float> xs((size_t)(p.rt.R * p.n_in)), ys((size_t)(p.rt.R * p.n_out));
    moe_gather(p.rt, p.x, p.n_in, p.k, p.per_slot, xs.data());
    for (int64_t e = 0; e < p.E; e++)
        if (p.rt.rows(e) > 0) moe_prefetch(w + e * expert_bytes, expert_bytes);
    // W[e] as gemm_on_blocks' [rows, row length]: its rows are the outputs (trans_b) or
    // the inputs.
    const int64_t rows_w = p.trans_b ? p.n_out : p.n_in, len_w = p.trans_b ? p.n_in : p.n_out;
    for (int64_t e = 0; e < p.E; e++) {
        const int64_t m = p.rt.rows(e), r0 = p.rt.off[e];
        if (m == 0) continue;
        const int kernel = p.trans_b && m <= DOT_MAX_M ? 2 : 1;
        const int rc = gemm_on_blocks(fmt, w + e * expert_bytes, row_bytes, rows_w, len_w,
                                      xs.data() + r0 * p.n_in, p.n_in, m,
                                      ys.data() + r0 * p.n_out, p.n_out, p.trans_b, kernel);
        if (rc != 0) return rc;
    }
    moe_scatter(p.rt, ys.data(), p.n_out, p.out);
    return 0;
}

// expert_matmul's weight gradient, out [E, ., .]: per expert e, over its slots,
// dW[e] = g^T x (trans_b: [n_out, n_in]) or x^T g ([n_in, n_out]); zero for an expert no
// slot chose. With L the gathered rows whose width is dW's rows (P) and Rr the other's
// (width Q), dW[e] = L_e^T Rr_e: a GEMM with L transposed once ([P, R], an expert's
// columns a run of it) as A and Rr_e as B. A narrow dW (Q below a strip, P wider: a LoRA
// B's [n_out, r]) is computed as its transpose, so the strips are full, and transposed.
// p: out, g [N, k, n_out], x, routes; i: N, k, n_in, n_out, E, trans_b, per_slot.
TG_REPLAY_KERNEL(expert_matmul_dw) {
    const ExpertProduct p = expert_product_of(n);
    const float* g = (const float*)n.p[1];
    const float* x = (const float*)n.p[2];
    if (!p.rt.valid()) return kMoeBadRoutes;
    const int64_t R = p.rt.R;
    std::vector<float> gs((size_t)(R * p.n_out)), xs((size_t)(R * p.n_in));
    moe_gather(p.rt, g, p.n_out, p.k, true, gs.data());
    moe_gather(p.rt, x, p.n_in, p.k, p.per_slot, xs.data());
    const float *L = p.trans_b ? gs.data() : xs.data(), *Rr = p.trans_b ? xs.data() : gs.data();
    const int64_t P = p.trans_b ? p.n_out : p.n_in, Q = p.trans_b ? p.n_in : p.n_out;
    const bool flipped = Q < NR && P > Q;   // compute dW^T [Q, P] = Rr^T L
    const float* left = flipped ? Rr : L;
    const float* right = flipped ? L : Rr;
    const int64_t rows = flipped ? Q : P, cols = flipped ? P : Q;
    std::vector<float> lt((size_t)(rows * R));   // left^T [rows, R]
    replay_for(rows, R, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++)
            for (int64_t r = 0; r < R; r++) lt[i * R + r] = left[r * rows + i];
    });
    std::vector<float> flip(flipped ? (size_t)(p.E * rows * cols) : 0);
    float* dst = flipped ? flip.data() : p.out;
    std::vector<MoeGemm> groups;
    for (int64_t e = 0; e < p.E; e++) {
        const int64_t r0 = p.rt.off[e];
        groups.push_back({lt.data() + r0, R, right + r0 * cols, cols, 1, dst + e * rows * cols,
                          cols, rows, p.rt.rows(e), cols});
    }
    moe_gemms(groups);
    if (flipped)
        replay_for(p.E * P, Q, [&](int64_t s0, int64_t s1) {
            for (int64_t s = s0; s < s1; s++) {   // s = (e, row of dW)
                const int64_t e = s / P, i = s % P;
                for (int64_t j = 0; j < Q; j++) p.out[s * Q + j] = flip[(e * Q + j) * P + i];
            }
        });
    return 0;
}
