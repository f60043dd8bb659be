// Fused causal attention, flash-style: softmax(scale * q k^T) v over tiles of BT queries x
// BT keys in shared memory, with an online softmax over the key tiles, so no [T, T] score
// matrix ever reaches global memory. q/o/dO are [B, H, T, hd] and k/v [B, KV, T, hd]
// (tok = 0), or token-major: q/o/dO [B, T, H, hd], k/v [B, T, KV, hd] (tok = 1, the
// projections' own rows; read and written through the row stride heads * hd, attn_head /
// attn_ld); gradients share their operands' layout. Query head h reads K/V head h / (H / KV)
// (grouped-query).
//
// Thread layout: BT * TPR threads, TPR consecutive lanes per tile row (a query row, or a
// key row in the dk/dv kernel). A thread scores the BT / TPR columns sub, sub + TPR, ...
// and owns the HD / TPR output features sub, sub + TPR, ...; row reductions are xor
// shuffles inside the TPR-lane group. Tiles are zero-filled past T and past hd, so every
// loop runs the full compile-time HD and register arrays are indexed by constants only.
// Shared rows are padded to HD + 1 / BT + 1 floats: the column walks hit distinct banks.
//
// The forward also writes the row log-sum-exp L = m + log(l) [B, H, T] (when lse is not
// null): the backward reads it instead of recomputing the row statistics.
//
// Backward (no float atomics, fixed summation orders: bit-identical run to run):
//   tg_attn_bwd_prep_*  per (query tile, head, batch): D = rowsum(dO * O) into scratch;
//   tg_attn_bwd_dkdv_*  per (key tile, kv head, batch): loops over the group's query
//                       heads and the query tiles that can see the key tile, accumulating
//                       dk = scale * dS^T q and dv = P^T dO in registers;
//   tg_attn_bwd_dq_*    per (query tile, head, batch): dq = scale * dS k over the visible
//                       key tiles;
// with P = exp(scale * q k^T - L) and dS = P * (dO v^T - D). The causal kernels skip the
// key tiles after the query tile (BT is the same for queries and keys).
//
// Sliding window (window > 0, causal only): query i sees key j iff j <= i and i - j <
// window -- transformers' sliding_window_overlay (kv_idx > q_idx - sliding_window) and
// llama.cpp's LLAMA_SWA_TYPE_STANDARD (masked when p1 - p0 >= n_swa). Whole tiles outside
// the window are skipped (attn_first_key_tile / attn_last_query_tile); the edge tiles are
// masked element by element in attn_visible.
//
// Segment ids (sample packing; segs [B, T] i32, or a null pointer): query i also needs
// segs[i] == segs[j] to see key j, so examples packed into one row stay apart. Each key
// tile's (or, in dk/dv, query tile's) ids go to shared memory; a tile in which no pair of
// the block meets is skipped whole (attn_tile_live: one shared flag, two barriers; the
// online softmax is unchanged by a skipped all-masked tile), the others are masked
// element by element (attn_same_seg). Without segment ids none of this runs.
//
// Attention sinks (sinks [H] f32, or a null pointer; gpt-oss): one more logit per query
// head in every row's softmax, with value 0. The online softmax starts from it (m = sink,
// l = 1) instead of from nothing (m = -inf, l = 0), so the L the forward saves includes it
// and the dq/dkdv kernels need no change; tg_attn_bwd_sinks
// then sums d sinks[h] = -sum_rows exp(sink - L) * D over (batch, query), one block per
// head in a fixed order.
//
// Instantiations (HD, BT, TPR), mirrored by lowering.ATTN_TILES: (32, 32, 4), (64, 32, 4),
// (128, 16, 8); a head_dim hd <= HD runs on the smallest such HD. Static shared memory
// stays under 48 KB in every kernel.

#define TG_ATTN_NEG_INF __int_as_float(0xff800000)

template <int TPR>
__device__ __forceinline__ float attn_group_max(float x) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

template <int TPR>
__device__ __forceinline__ float attn_group_sum(float x) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Where head `head` of batch row b starts in a [B, heads, T, hd] tensor (tok = 0) or a
// token-major [B, T, heads, hd] one (tok = 1), and the stride between its rows.
__device__ __forceinline__ long long attn_head(int b, int head, int heads, int T, int hd,
                                               int tok) {
    return ((long long)b * heads * T + (tok ? head : (long long)head * T)) * hd;
}

__device__ __forceinline__ int attn_ld(int heads, int hd, int tok) { return tok ? heads * hd : hd; }

// Rows [r0, r0 + BT) of a [T, hd] matrix with row stride ld into S[BT][HD + 1], zeros past
// T and past hd.
template <int HD, int BT>
__device__ __forceinline__ void attn_load(float (*S)[HD + 1], const float* src, int r0, int T,
                                          int hd, int ld) {
    for (int idx = threadIdx.x; idx < BT * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD;
        S[r][d] = (r0 + r < T && d < hd) ? src[(long long)(r0 + r) * ld + d] : 0.0f;
    }
}

__device__ __forceinline__ bool attn_visible(int i, int j, int T, int causal, int window) {
    return i < T && j < T && (!causal || j <= i) && (window == 0 || i - j < window);
}

__device__ __forceinline__ int attn_tiles(int T, int BT) { return (T + BT - 1) / BT; }

// Segment id of row i of one batch row's ids (0 for every row without ids, or past T).
__device__ __forceinline__ int attn_seg(const int* segs, int i, int T) {
    return segs != nullptr && i < T ? segs[i] : 0;
}

// Whether tile column x (ids S in shared memory; null: no segment ids) is in segment own.
__device__ __forceinline__ bool attn_same_seg(const int* S, int x, int own) {
    return S == nullptr || S[x] == own;
}

// Segment ids only: loads the ids of tile rows [base, base + BT) into S and says whether
// any pair this block tests meets (same segment, visible by causality and window). A
// thread holds its own row `own` (segment own_seg) and tests columns sub, sub + TPR, ...
// of the tile; ROWS_ARE_QUERIES says whether `own` is a query (forward, prep, dq) or a
// key (dk/dv). Block-uniform through the shared flag: every thread must call it.
template <int BT, int TPR, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ bool attn_tile_live(int* S, int* live, const int* segs, int own,
                                               int own_seg, int base, int sub, int T,
                                               int causal, int window) {
    for (int x = threadIdx.x; x < BT; x += blockDim.x) S[x] = attn_seg(segs, base + x, T);
    if (threadIdx.x == 0) *live = 0;
    __syncthreads();
    bool meets = false;
#pragma unroll
    for (int c = 0; c < N; ++c) {
        const int x = sub + TPR * c;
        meets = meets || (S[x] == own_seg &&
                          (ROWS_ARE_QUERIES ? attn_visible(own, base + x, T, causal, window)
                                            : attn_visible(base + x, own, T, causal, window)));
    }
    if (meets) *live = 1;
    __syncthreads();
    return *live != 0;
}

// The first key tile query tile qt sees: its first query i0 sees keys from i0 - window + 1
// on, and every later query of the tile starts later still.
__device__ __forceinline__ int attn_first_key_tile(int qt, int BT, int window) {
    return window > 0 ? max(0, qt * BT - window + 1) / BT : 0;
}

// The last query tile that sees key tile kt: its last key j0 + BT - 1 is seen by queries
// up to j0 + BT - 1 + window - 1.
__device__ __forceinline__ int attn_last_query_tile(int kt, int BT, int window, int nt) {
    return window > 0 ? min(nt - 1, (kt * BT + BT - 1 + window - 1) / BT) : nt - 1;
}

// Scaled, masked (causal, window) scores of query row r (global row i) against this
// thread's NK keys of the key tile starting at j0 (-inf where masked); returns their
// maximum.
template <int HD, int TPR, int NK>
__device__ __forceinline__ float attn_row_scores(float (&s)[NK], const float (*Qs)[HD + 1],
                                                 const float (*Ks)[HD + 1], const int* Sk,
                                                 int sq, int r, int sub, int i, int j0, int T,
                                                 int causal, int window, float scale) {
#pragma unroll
    for (int c = 0; c < NK; ++c) s[c] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < HD; ++d) {
        float qd = Qs[r][d];
#pragma unroll
        for (int c = 0; c < NK; ++c) s[c] = fmaf(qd, Ks[sub + TPR * c][d], s[c]);
    }
    float mt = TG_ATTN_NEG_INF;
#pragma unroll
    for (int c = 0; c < NK; ++c) {
        const int jj = sub + TPR * c;
        s[c] = attn_visible(i, j0 + jj, T, causal, window) && attn_same_seg(Sk, jj, sq)
                   ? __fmul_rn(s[c], scale) : TG_ATTN_NEG_INF;
        mt = fmaxf(mt, s[c]);
    }
    return mt;
}

template <int HD, int BT, int TPR>
__device__ __forceinline__ void attn_fwd(float* out, float* lse, const float* q,
                                         const float* k, const float* v, const int* segs,
                                         const float* sinks, int H, int KV, int T, int hd,
                                         float scale, int causal, int window, int tok) {
    constexpr int NK = BT / TPR, ND = HD / TPR;
    __shared__ float Qs[BT][HD + 1];
    __shared__ float KVs[BT][HD + 1];
    __shared__ float Ps[BT][BT + 1];
    __shared__ int Sk[BT], live;
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int r = threadIdx.x / TPR, sub = threadIdx.x % TPR;
    const int i0 = qt * BT, i = i0 + r;
    const int ldq = attn_ld(H, hd, tok), ldk = attn_ld(KV, hd, tok);
    const long long q_off = attn_head(b, h, H, T, hd, tok);
    const float* K = k + attn_head(b, kvh, KV, T, hd, tok);
    const float* V = v + attn_head(b, kvh, KV, T, hd, tok);
    if (segs != nullptr) segs += (long long)b * T;
    const int sq = attn_seg(segs, i, T);
    const int* Skp = segs != nullptr ? Sk : nullptr;
    attn_load<HD, BT>(Qs, q + q_off, i0, T, hd, ldq);
    float m = sinks != nullptr ? sinks[h] : TG_ATTN_NEG_INF;
    float l = sinks != nullptr ? 1.0f : 0.0f, acc[ND];
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) acc[dd] = 0.0f;
    const int last = causal ? qt : attn_tiles(T, BT) - 1;
    for (int kt = attn_first_key_tile(qt, BT, window); kt <= last; ++kt) {
        const int j0 = kt * BT;
        __syncthreads();  // the previous tile's V, P and ids are no longer read
        if (segs != nullptr && !attn_tile_live<BT, TPR, NK, true>(Sk, &live, segs, i, sq, j0,
                                                                   sub, T, causal, window))
            continue;
        attn_load<HD, BT>(KVs, K, j0, T, hd, ldk);
        __syncthreads();
        float s[NK];
        const float mt = attn_row_scores<HD, TPR, NK>(s, Qs, KVs, Skp, sq, r, sub, i, j0, T,
                                                       causal, window, scale);
        const float mn = fmaxf(m, attn_group_max<TPR>(mt));
        const float base = mn == TG_ATTN_NEG_INF ? 0.0f : mn;  // a row with nothing seen yet
        const float alpha = expf(__fsub_rn(m, base));
        float ls = 0.0f;
#pragma unroll
        for (int c = 0; c < NK; ++c) {
            float pc = expf(__fsub_rn(s[c], base));
            Ps[r][sub + TPR * c] = pc;
            ls = __fadd_rn(ls, pc);
        }
        l = fmaf(l, alpha, attn_group_sum<TPR>(ls));
        m = mn;
#pragma unroll
        for (int dd = 0; dd < ND; ++dd) acc[dd] = __fmul_rn(acc[dd], alpha);
        __syncthreads();  // K is no longer read; P is complete
        attn_load<HD, BT>(KVs, V, j0, T, hd, ldk);
        __syncthreads();
        for (int jj = 0; jj < BT; ++jj) {
            float pj = Ps[r][jj];
#pragma unroll
            for (int dd = 0; dd < ND; ++dd) acc[dd] = fmaf(pj, KVs[jj][sub + TPR * dd], acc[dd]);
        }
    }
    if (i < T) {
        float* O = out + q_off + (long long)i * ldq;
#pragma unroll
        for (int dd = 0; dd < ND; ++dd) {
            int d = sub + TPR * dd;
            if (d < hd) O[d] = __fdiv_rn(acc[dd], l);
        }
        // Every lane of the row's group holds the same m and l (xor shuffles).
        if (lse != nullptr && sub == 0) lse[((long long)b * H + h) * T + i] = __fadd_rn(m, logf(l));
    }
}

// D = rowsum(dO * O) [B, H, T], each row summed by its TPR lanes in the order the
// backward always has (fmaf over the lane's features, then the group's xor shuffles).
template <int HD, int BT, int TPR>
__device__ __forceinline__ void attn_bwd_prep(float* delta, const float* o, const float* g,
                                              int H, int T, int hd, int tok) {
    constexpr int ND = HD / TPR;
    const int h = blockIdx.y, b = blockIdx.z;
    const int i = blockIdx.x * BT + threadIdx.x / TPR, sub = threadIdx.x % TPR;
    float dsum = 0.0f;
    if (i < T) {
        const long long row = attn_head(b, h, H, T, hd, tok) + (long long)i * attn_ld(H, hd, tok);
#pragma unroll
        for (int dd = 0; dd < ND; ++dd) {
            int d = sub + TPR * dd;
            if (d < hd) dsum = fmaf(g[row + d], o[row + d], dsum);
        }
    }
    dsum = attn_group_sum<TPR>(dsum);
    if (i < T && sub == 0) delta[((long long)b * H + h) * T + i] = dsum;
}

// dk and dv of one key tile of one kv head, summed over the group's query heads.
template <int HD, int BT, int TPR>
__device__ __forceinline__ void attn_bwd_dkdv(float* dk, float* dv, const float* q,
                                              const float* k, const float* v, const float* g,
                                              const float* lse, const float* delta,
                                              const int* segs, int H, int KV, int T, int hd,
                                              float scale, int causal, int window, int tok) {
    constexpr int NQ = BT / TPR, ND = HD / TPR;
    __shared__ float Ks[BT][HD + 1];
    __shared__ float Vs[BT][HD + 1];
    __shared__ float Qs[BT][HD + 1];
    __shared__ float Gs[BT][HD + 1];
    __shared__ float Ps[BT][BT + 1];   // [key][query]
    __shared__ float Ss[BT][BT + 1];   // dS, [key][query]
    __shared__ float Ls[BT], Ds[BT];
    __shared__ int Sq[BT], live;
    const int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = H / KV;
    const int c = threadIdx.x / TPR, sub = threadIdx.x % TPR;
    const int j0 = kt * BT, j = j0 + c;
    if (segs != nullptr) segs += (long long)b * T;
    const int sk = attn_seg(segs, j, T);
    const int* Sqp = segs != nullptr ? Sq : nullptr;
    const int ldq = attn_ld(H, hd, tok), ldk = attn_ld(KV, hd, tok);
    const long long kv_off = attn_head(b, kvh, KV, T, hd, tok);
    attn_load<HD, BT>(Ks, k + kv_off, j0, T, hd, ldk);
    attn_load<HD, BT>(Vs, v + kv_off, j0, T, hd, ldk);
    float dka[ND], dva[ND];
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) dka[dd] = dva[dd] = 0.0f;
    const int last = attn_last_query_tile(kt, BT, window, attn_tiles(T, BT));
    for (int gi = 0; gi < G; ++gi) {
        const int h = kvh * G + gi;
        const long long q_off = attn_head(b, h, H, T, hd, tok);
        const float* L = lse + ((long long)b * H + h) * T;
        const float* D = delta + ((long long)b * H + h) * T;
        for (int qt = causal ? kt : 0; qt <= last; ++qt) {
            const int i0 = qt * BT;
            __syncthreads();  // the previous query tile is no longer read
            if (segs != nullptr && !attn_tile_live<BT, TPR, NQ, false>(Sq, &live, segs, j, sk, i0,
                                                                        sub, T, causal, window))
                continue;
            attn_load<HD, BT>(Qs, q + q_off, i0, T, hd, ldq);
            attn_load<HD, BT>(Gs, g + q_off, i0, T, hd, ldq);
            for (int x = threadIdx.x; x < BT; x += blockDim.x) {
                Ls[x] = i0 + x < T ? L[i0 + x] : 0.0f;
                Ds[x] = i0 + x < T ? D[i0 + x] : 0.0f;
            }
            __syncthreads();
            float s[NQ], dp[NQ];
#pragma unroll
            for (int m = 0; m < NQ; ++m) s[m] = dp[m] = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HD; ++d) {
                float kd = Ks[c][d], vd = Vs[c][d];
#pragma unroll
                for (int m = 0; m < NQ; ++m) {
                    s[m] = fmaf(Qs[sub + TPR * m][d], kd, s[m]);
                    dp[m] = fmaf(Gs[sub + TPR * m][d], vd, dp[m]);
                }
            }
#pragma unroll
            for (int m = 0; m < NQ; ++m) {
                int ii = sub + TPR * m;
                float p = attn_visible(i0 + ii, j, T, causal, window) && attn_same_seg(Sqp, ii, sk)
                              ? expf(__fsub_rn(__fmul_rn(s[m], scale), Ls[ii])) : 0.0f;
                Ps[c][ii] = p;
                Ss[c][ii] = __fmul_rn(__fmul_rn(p, __fsub_rn(dp[m], Ds[ii])), scale);
            }
            __syncthreads();
            for (int ii = 0; ii < BT; ++ii) {
                float p = Ps[c][ii], ds = Ss[c][ii];
#pragma unroll
                for (int dd = 0; dd < ND; ++dd) {
                    dva[dd] = fmaf(p, Gs[ii][sub + TPR * dd], dva[dd]);
                    dka[dd] = fmaf(ds, Qs[ii][sub + TPR * dd], dka[dd]);
                }
            }
        }
    }
    if (j < T) {
        const long long row = kv_off + (long long)j * ldk;
#pragma unroll
        for (int dd = 0; dd < ND; ++dd) {
            int d = sub + TPR * dd;
            if (d < hd) {
                dk[row + d] = dka[dd];
                dv[row + d] = dva[dd];
            }
        }
    }
}

// dq of one query tile of one head.
template <int HD, int BT, int TPR>
__device__ __forceinline__ void attn_bwd_dq(float* dq, const float* q, const float* k,
                                            const float* v, const float* g, const float* lse,
                                            const float* delta, const int* segs, int H, int KV,
                                            int T, int hd, float scale, int causal, int window,
                                            int tok) {
    constexpr int NK = BT / TPR, ND = HD / TPR;
    __shared__ float Qs[BT][HD + 1];
    __shared__ float Gs[BT][HD + 1];
    __shared__ float Ks[BT][HD + 1];
    __shared__ float Vs[BT][HD + 1];
    __shared__ float Ss[BT][BT + 1];   // dS, [query][key]
    __shared__ int Sk[BT], live;
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int r = threadIdx.x / TPR, sub = threadIdx.x % TPR;
    const int i0 = qt * BT, i = i0 + r;
    const int ldq = attn_ld(H, hd, tok), ldk = attn_ld(KV, hd, tok);
    const long long q_off = attn_head(b, h, H, T, hd, tok);
    const long long kv_off = attn_head(b, kvh, KV, T, hd, tok);
    if (segs != nullptr) segs += (long long)b * T;
    const int sq = attn_seg(segs, i, T);
    const int* Skp = segs != nullptr ? Sk : nullptr;
    attn_load<HD, BT>(Qs, q + q_off, i0, T, hd, ldq);
    attn_load<HD, BT>(Gs, g + q_off, i0, T, hd, ldq);
    const long long at = ((long long)b * H + h) * T + i;
    const float Li = i < T ? lse[at] : 0.0f, Di = i < T ? delta[at] : 0.0f;
    float acc[ND];
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) acc[dd] = 0.0f;
    const int last = causal ? qt : attn_tiles(T, BT) - 1;
    for (int kt = attn_first_key_tile(qt, BT, window); kt <= last; ++kt) {
        const int j0 = kt * BT;
        __syncthreads();
        if (segs != nullptr && !attn_tile_live<BT, TPR, NK, true>(Sk, &live, segs, i, sq, j0,
                                                                   sub, T, causal, window))
            continue;
        attn_load<HD, BT>(Ks, k + kv_off, j0, T, hd, ldk);
        attn_load<HD, BT>(Vs, v + kv_off, j0, T, hd, ldk);
        __syncthreads();
        float s[NK], dp[NK];
#pragma unroll
        for (int c = 0; c < NK; ++c) s[c] = dp[c] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < HD; ++d) {
            float qd = Qs[r][d], gd = Gs[r][d];
#pragma unroll
            for (int c = 0; c < NK; ++c) {
                s[c] = fmaf(qd, Ks[sub + TPR * c][d], s[c]);
                dp[c] = fmaf(gd, Vs[sub + TPR * c][d], dp[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < NK; ++c) {
            int jj = sub + TPR * c;
            float p = attn_visible(i, j0 + jj, T, causal, window) && attn_same_seg(Skp, jj, sq)
                          ? expf(__fsub_rn(__fmul_rn(s[c], scale), Li)) : 0.0f;
            Ss[r][jj] = __fmul_rn(__fmul_rn(p, __fsub_rn(dp[c], Di)), scale);
        }
        __syncthreads();
        for (int jj = 0; jj < BT; ++jj) {
            float ds = Ss[r][jj];
#pragma unroll
            for (int dd = 0; dd < ND; ++dd) acc[dd] = fmaf(ds, Ks[jj][sub + TPR * dd], acc[dd]);
        }
    }
    if (i < T) {
        const long long row = q_off + (long long)i * ldq;
#pragma unroll
        for (int dd = 0; dd < ND; ++dd) {
            int d = sub + TPR * dd;
            if (d < hd) dq[row + d] = acc[dd];
        }
    }
}

// d sinks[h] = -sum over (b, i) of exp(sinks[h] - L[b, h, i]) * D[b, h, i]: one block per
// head (grid-stride), each thread summing its strided rows in order, then a tree.
extern "C" __global__ void tg_attn_bwd_sinks(float* dsinks, const float* sinks,
                                             const float* lse, const float* delta, int B,
                                             int H, int T) {
    __shared__ float sh[TG_THREADS];
    for (int h = blockIdx.x; h < H; h += gridDim.x) {
        float acc = 0.0f;
        for (int x = threadIdx.x; x < B * T; x += blockDim.x) {
            const long long at = ((long long)(x / T) * H + h) * T + x % T;
            acc = fmaf(expf(__fsub_rn(sinks[h], lse[at])), delta[at], acc);
        }
        acc = tg_block_sum(acc, sh);
        if (threadIdx.x == 0) dsinks[h] = -acc;
    }
}

// ---- instantiations: grid (query or key tiles, heads or kv heads, batch), BT * TPR threads
#define TG_ATTN_FWD_ARGS                                                                  \
    float *out, float *lse, const float *q, const float *k, const float *v, const int *segs, \
        const float *sinks, int H, int KV, int T, int hd, float scale, int causal, int window, \
        int tok
#define TG_ATTN_FWD_CALL out, lse, q, k, v, segs, sinks, H, KV, T, hd, scale, causal, window, tok
#define TG_ATTN_PREP_ARGS float *delta, const float *o, const float *g, int H, int T, int hd, int tok
#define TG_ATTN_DKDV_ARGS                                                                 \
    float *dk, float *dv, const float *q, const float *k, const float *v, const float *g,    \
        const float *lse, const float *delta, const int *segs, int H, int KV, int T, int hd, \
        float scale, int causal, int window, int tok
#define TG_ATTN_DQ_ARGS                                                                   \
    float *dq, const float *q, const float *k, const float *v, const float *g,              \
        const float *lse, const float *delta, const int *segs, int H, int KV, int T, int hd, \
        float scale, int causal, int window, int tok
#define TG_ATTN_BWD_CALL q, k, v, g, lse, delta, segs, H, KV, T, hd, scale, causal, window, tok

extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_32) tg_attn_fwd_32(TG_ATTN_FWD_ARGS) {
    attn_fwd<32, TG_ATTN_BT_32, TG_ATTN_TPR_32>(TG_ATTN_FWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_64) tg_attn_fwd_64(TG_ATTN_FWD_ARGS) {
    attn_fwd<64, TG_ATTN_BT_64, TG_ATTN_TPR_64>(TG_ATTN_FWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_128) tg_attn_fwd_128(TG_ATTN_FWD_ARGS) {
    attn_fwd<128, TG_ATTN_BT_128, TG_ATTN_TPR_128>(TG_ATTN_FWD_CALL);
}

extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_32) tg_attn_bwd_prep_32(TG_ATTN_PREP_ARGS) {
    attn_bwd_prep<32, TG_ATTN_BT_32, TG_ATTN_TPR_32>(delta, o, g, H, T, hd, tok);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_64) tg_attn_bwd_prep_64(TG_ATTN_PREP_ARGS) {
    attn_bwd_prep<64, TG_ATTN_BT_64, TG_ATTN_TPR_64>(delta, o, g, H, T, hd, tok);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_128) tg_attn_bwd_prep_128(TG_ATTN_PREP_ARGS) {
    attn_bwd_prep<128, TG_ATTN_BT_128, TG_ATTN_TPR_128>(delta, o, g, H, T, hd, tok);
}

extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_32) tg_attn_bwd_dkdv_32(TG_ATTN_DKDV_ARGS) {
    attn_bwd_dkdv<32, TG_ATTN_BT_32, TG_ATTN_TPR_32>(dk, dv, TG_ATTN_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_64) tg_attn_bwd_dkdv_64(TG_ATTN_DKDV_ARGS) {
    attn_bwd_dkdv<64, TG_ATTN_BT_64, TG_ATTN_TPR_64>(dk, dv, TG_ATTN_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_128) tg_attn_bwd_dkdv_128(TG_ATTN_DKDV_ARGS) {
    attn_bwd_dkdv<128, TG_ATTN_BT_128, TG_ATTN_TPR_128>(dk, dv, TG_ATTN_BWD_CALL);
}

extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_32) tg_attn_bwd_dq_32(TG_ATTN_DQ_ARGS) {
    attn_bwd_dq<32, TG_ATTN_BT_32, TG_ATTN_TPR_32>(dq, TG_ATTN_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_64) tg_attn_bwd_dq_64(TG_ATTN_DQ_ARGS) {
    attn_bwd_dq<64, TG_ATTN_BT_64, TG_ATTN_TPR_64>(dq, TG_ATTN_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_ATTN_THREADS_128) tg_attn_bwd_dq_128(TG_ATTN_DQ_ARGS) {
    attn_bwd_dq<128, TG_ATTN_BT_128, TG_ATTN_TPR_128>(dq, TG_ATTN_BWD_CALL);
}
