// Tensor-core flash attention, FlashAttention-2 style (the bf16 precision's attention; the
// f32 kernels of flash_attention.cu stay the exact path). Same math, masks, grouped-query
// heads, segment ids, sliding windows and sinks as flash_attention.cu (its attn_visible is
// shared); the numbers differ only by bf16 operand rounding.
//
// Operands: q [B, H, T, HD], k/v [B, KV, T, HD] and dO as bf16, rows zero-padded from the
// real head_dim hd to the kernel's bound HD (tg_tca_to_bf16 / tg_tca_bwd_prep write these
// copies from the activations, f32 or bf16, heads first whatever the activations' layout:
// a token-major source, tok = 1, is read through its row stride), or, where an activation
// is already what the kernel reads -- bf16, token-major, hd == HD -- that activation as it
// lies (bit j of `asis`: q, k, v, dO), its rows heads * HD apart (attn_head / attn_ld).
// mma.sync m16n8k16 bf16 with f32 accumulation; softmax
// statistics, P's row sums, the log-sum-exp and every output in f32. Outputs o, dq, dk, dv
// are f32 in the operands' layout (flash_attention.cu's attn_head / attn_ld), L [B, H, T].
//
// Blocks: 4 warps; each warp owns 16 rows of the block's 64 (queries in the forward and
// dq, keys in dk/dv), whose operand fragments are staged through shared memory once and
// then kept in registers (ldmatrix). The other operand streams through shared memory in
// tiles of TILE rows (TG_TCA_TILE_<HD>), two stages, filled with cp.async while the tensor
// cores work on the other stage (cp.async.wait_group 1, then a barrier). Rows are HD + 8
// halves apart so ldmatrix's eight 16-byte row reads fall in distinct banks. A score tile's
// accumulators become the next mma's A operand in registers (FA2): the C fragment of two
// adjacent n-tiles is exactly the A fragment of one k-step (tca_c_to_a).
//
// Fragment index math (PTX ISA, see tc_layout.cuh for the mma layouts and tc_async.cuh for
// ldmatrix): lane l, g = l >> 2, t = l & 3.
//   A, rows [16] x k [16] stored row-major: ldmatrix.x4 with lane l at row l & 15, column
//     8 (l >> 4) -> registers a0a1 a2a3 a4a5 a6a7 (tca_a_frags).
//   B from n-major storage ([n][k], the Q K^T case): ldmatrix.x4 with lane l at n row
//     (l & 7) + 8 (l >> 4), column 8 ((l >> 3) & 1) -> b of n-tiles n0 and n0 + 8 (tca_b_nk).
//   B from k-major storage ([k][n], the P V case): ldmatrix.x4.trans with lane l at k row
//     (l & 7) + 8 ((l >> 3) & 1), column 8 (l >> 4) (tca_b_kn).
//   C: c_e at row g + 8 (e >> 1), column 2t + (e & 1).
//
// Kernels (HD in 64, 128, 256; grid (tiles of 64 rows, heads or kv heads, batch), 128
// threads, static shared memory TG_TCA_SMEM_<HD> halves, under 48 KB):
//   tg_tca_fwd_<HD>       o and the row log-sum-exp L = m + log(l) (f32 [B, H, T], natural
//                         log of the scaled scores, sinks included) when lse is not null:
//                         the attention node saves L for the backward.
//   tg_tca_bwd_dkdv_<HD>  per (key tile, kv head): dv = P^T dO, dk = dS^T q over the
//                         group's query heads and visible query tiles, in a fixed order;
//   tg_tca_bwd_dq_<HD>    per (query tile, head): dq = dS k over the visible key tiles;
// with P = exp(scale q k^T - L) (the forward's L) and dS = P (dO v^T - D) scale, D =
// rowsum(dO o) (f32, from tg_tca_bwd_prep). No atomics: each output element is one thread's fixed chain of mma,
// bit-identical run to run. Causal blocks stop at the last key tile their last query sees
// (and dk/dv blocks start at the first query tile that sees their first key); windows skip
// the tiles before the window; the edge tiles are masked element by element.

#define TG_TCA_NEG_INF __int_as_float(0xff800000)

// Rows [r0, r0 + ROWS) of a [T, HD] bf16 matrix, rows ld apart, into S[ROWS][HD + PAD]
// with cp.async, the block's threads taking the 16-byte chunks in turn; rows past T are
// zero-filled.
template <int HD, int ROWS>
__device__ __forceinline__ void tca_issue(unsigned short* S, const unsigned short* src, int r0,
                                          int T, int ld) {
    constexpr int CH = HD / 8, LD = HD + TG_TCA_PAD;
    for (int c = threadIdx.x; c < ROWS * CH; c += blockDim.x) {
        const int r = c / CH, col = (c % CH) * 8;
        const bool in = r0 + r < T;
        tg_cp_async16(S + r * LD + col, src + (in ? (long long)(r0 + r) * ld + col : 0),
                      in ? 16 : 0);
    }
}

// The A fragments of a warp's 16 rows (at S, row stride HD + PAD), every k-step of HD.
template <int HD>
__device__ __forceinline__ void tca_a_frags(unsigned (&f)[HD / 16][4], const unsigned short* S,
                                            int lane) {
    constexpr int LD = HD + TG_TCA_PAD;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks)
        tg_ldmatrix<4, false>(f[ks], S + (lane & 15) * LD + ks * 16 + (lane >> 4) * 8);
}

// B fragments of n-tiles n0 (b[0], b[1]) and n0 + 8 (b[2], b[3]) at k-step k0, from
// [n][k] storage.
__device__ __forceinline__ void tca_b_nk(unsigned (&b)[4], const unsigned short* S, int LD,
                                         int n0, int k0, int lane) {
    tg_ldmatrix<4, false>(b, S + (n0 + (lane & 7) + 8 * (lane >> 4)) * LD + k0
                                 + 8 * ((lane >> 3) & 1));
}

// The same from [k][n] storage, transposed by ldmatrix.
__device__ __forceinline__ void tca_b_kn(unsigned (&b)[4], const unsigned short* S, int LD,
                                         int k0, int n0, int lane) {
    tg_ldmatrix<4, true>(b, S + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + n0
                                + 8 * (lane >> 4));
}

__device__ __forceinline__ unsigned tca_pack(float lo, float hi) {
    return (unsigned)TcBF16::cvt(lo) | ((unsigned)TcBF16::cvt(hi) << 16);
}

// The A fragment of one k-step from the C fragments of its two n-tiles (c0: k 0..7, c1:
// k 8..15), rounded to bf16.
__device__ __forceinline__ void tca_c_to_a(unsigned (&a)[4], const float (&c0)[4],
                                           const float (&c1)[4]) {
    a[0] = tca_pack(c0[0], c0[1]);
    a[1] = tca_pack(c0[2], c0[3]);
    a[2] = tca_pack(c1[0], c1[1]);
    a[3] = tca_pack(c1[2], c1[3]);
}

__device__ __forceinline__ bool tca_sees(int i, int j, const int* segs, int T, int causal,
                                         int window) {
    return attn_visible(i, j, T, causal, window) && (segs == nullptr || segs[i] == segs[j]);
}

__device__ __forceinline__ float tca_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float tca_quad_sum(float x) {
    x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The key tiles (of TILE rows) the queries [i0, i0 + 64) see: [first, last].
__device__ __forceinline__ void tca_key_tiles(int i0, int TILE, int T, int causal, int window,
                                              int& first, int& last) {
    first = window > 0 ? max(0, i0 - window + 1) / TILE : 0;
    last = ((causal ? min(i0 + TG_TCA_BQ, T) : T) - 1) / TILE;
}

// The A fragments of the warp's 16 of rows [r0, r0 + 64) of a [T, HD] matrix (rows ld
// apart), staged through the block's buffer, which is free again on return (every thread
// calls it).
template <int HD>
__device__ __forceinline__ void tca_stage_frags(unsigned (&f)[HD / 16][4], unsigned short* smem,
                                                const unsigned short* src, int r0, int T, int ld) {
    tca_issue<HD, TG_TCA_BQ>(smem, src, r0, T, ld);
    tg_cp_async_commit();
    tg_cp_async_wait<0>();
    __syncthreads();
    tca_a_frags<HD>(f, smem + (threadIdx.x >> 5) * 16 * (HD + TG_TCA_PAD), threadIdx.x & 31);
    __syncthreads();
}

template <int N>
__device__ __forceinline__ void tca_zero(float (&c)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
}

// c[16][N * 8] += A S^T: A the warp's row fragments over HD, S an n-major tile [N * 8][HD]
// (keys for q k^T, queries for k q^T).
template <int HD, int N>
__device__ __forceinline__ void tca_mma_nk(float (&c)[N][4], const unsigned (&a)[HD / 16][4],
                                           const unsigned short* S, int lane) {
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks)
#pragma unroll
        for (int np = 0; np < N / 2; ++np) {
            unsigned b[4];
            tca_b_nk(b, S, HD + TG_TCA_PAD, 16 * np, 16 * ks, lane);
            TcBF16::mma(c[2 * np], a[ks], b);
            TcBF16::mma(c[2 * np + 1], a[ks], b + 2);
        }
}

// c[16][HD] += A S[k0 .. k0 + 16): A one k-step's fragment (tca_c_to_a of P or dS), S a
// k-major tile [.][HD] (v, dO, q or k rows).
template <int HD>
__device__ __forceinline__ void tca_mma_kn(float (&c)[HD / 8][4], const unsigned (&a)[4],
                                           const unsigned short* S, int k0, int lane) {
#pragma unroll
    for (int op = 0; op < HD / 16; ++op) {
        unsigned b[4];
        tca_b_kn(b, S, HD + TG_TCA_PAD, k0, 16 * op, lane);
        TcBF16::mma(c[2 * op], a, b);
        TcBF16::mma(c[2 * op + 1], a, b + 2);
    }
}

// c[16][HD] += P S over a key tile: P the warp's [16][TILE] scores or their gradient (C
// fragments, TILE / 8 n-tiles; two adjacent ones are one k-step's A), S [TILE][HD] in shared
// memory (v, dO, q or k rows). The P v, dS k, P^T dO and dS^T q products.
template <int HD, int TILE>
__device__ __forceinline__ void tca_mma_tile(float (&c)[HD / 8][4], const float (&p)[TILE / 8][4],
                                             const unsigned short* S, int lane) {
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) {
        unsigned a[4];
        tca_c_to_a(a, p[2 * kk], p[2 * kk + 1]);
        tca_mma_kn<HD>(c, a, S, 16 * kk, lane);
    }
}

// The warp's C tile [16][HD] into rows rows[0], rows[1] (those < T) of dst [T, hd] (row
// stride ld), columns < hd, each row divided by div[r] when div is given (the forward's 1 / l).
template <int HD>
__device__ __forceinline__ void tca_store(float* dst, const float (&c)[HD / 8][4],
                                          const int (&rows)[2], int T, int hd, int ld,
                                          const float* div = nullptr) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= T) continue;
#pragma unroll
        for (int ot = 0; ot < HD / 8; ++ot)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                const int d = ot * 8 + 2 * t + (e & 1);
                if (d < hd)
                    dst[(long long)rows[r] * ld + d] = div ? __fdiv_rn(c[ot][e], div[r]) : c[ot][e];
            }
    }
}

// One step of the key-tile pipeline over tiles [first, last], kt running from first - 1:
// stages tile kt + 1 (k and v) into the other stage, then waits for tile kt (stage
// (kt - first) & 1) and syncs. False on the prologue step. Every thread calls it.
template <int HD, int TILE>
__device__ __forceinline__ bool tca_key_tile_ready(unsigned short* smem, const unsigned short* K,
                                                   const unsigned short* V, int kt, int first,
                                                   int last, int T, int ldk, int ldv) {
    constexpr int LD = HD + TG_TCA_PAD;
    if (kt < last) {
        unsigned short* nx = smem + ((kt + 1 - first) & 1) * 2 * TILE * LD;
        tca_issue<HD, TILE>(nx, K, (kt + 1) * TILE, T, ldk);
        tca_issue<HD, TILE>(nx + TILE * LD, V, (kt + 1) * TILE, T, ldv);
        tg_cp_async_commit();
    }
    if (kt < first) return false;
    if (kt < last) tg_cp_async_wait<1>();
    else tg_cp_async_wait<0>();
    __syncthreads();
    return true;
}

// Forward: o and L (null: not stored) of 64 queries of one head.
template <int HD, int TILE>
__device__ __forceinline__ void tca_fwd(unsigned short* smem, float* out, float* lse,
                                        const unsigned short* q, const unsigned short* k,
                                        const unsigned short* v, const int* segs,
                                        const float* sinks, int H, int KV, int T, int hd,
                                        float scale, int causal, int window, int tok, int asis) {
    constexpr int LD = HD + TG_TCA_PAD, NT = TILE / 8, OT = HD / 8;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int i0 = blockIdx.x * TG_TCA_BQ;
    const int tq = asis & 1, tk = (asis >> 1) & 1, tv = (asis >> 2) & 1;
    const unsigned short* K = k + attn_head(b, kvh, KV, T, HD, tk);
    const unsigned short* V = v + attn_head(b, kvh, KV, T, HD, tv);
    const int ldk = attn_ld(KV, HD, tk), ldv = attn_ld(KV, HD, tv);
    if (segs != nullptr) segs += (long long)b * T;
    unsigned qf[HD / 16][4];
    tca_stage_frags<HD>(qf, smem, q + attn_head(b, h, H, T, HD, tq), i0, T, attn_ld(H, HD, tq));
    const int rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    float m[2], l[2], o[OT][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m[r] = sinks != nullptr ? sinks[h] : TG_TCA_NEG_INF;
        l[r] = sinks != nullptr ? 1.0f : 0.0f;
    }
    tca_zero<OT>(o);
    int first, last;
    tca_key_tiles(i0, TILE, T, causal, window, first, last);
    for (int kt = first - 1; kt <= last; ++kt) {
        if (!tca_key_tile_ready<HD, TILE>(smem, K, V, kt, first, last, T, ldk, ldv)) continue;
        const unsigned short* Ks = smem + ((kt - first) & 1) * 2 * TILE * LD;
        const unsigned short* Vs = Ks + TILE * LD;
        float s[NT][4];
        tca_zero<NT>(s);
        tca_mma_nk<HD, NT>(s, qf, Ks, lane);
        float mt[2] = {TG_TCA_NEG_INF, TG_TCA_NEG_INF}, base[2], alpha[2], ls[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = kt * TILE + nt * 8 + 2 * t + (e & 1);
                s[nt][e] = tca_sees(rows[e >> 1], j, segs, T, causal, window)
                               ? __fmul_rn(s[nt][e], scale) : TG_TCA_NEG_INF;
                mt[e >> 1] = fmaxf(mt[e >> 1], s[nt][e]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float mn = fmaxf(m[r], tca_quad_max(mt[r]));
            base[r] = mn == TG_TCA_NEG_INF ? 0.0f : mn;  // a row with nothing seen yet
            alpha[r] = expf(__fsub_rn(m[r], base[r]));
            m[r] = mn;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = expf(__fsub_rn(s[nt][e], base[e >> 1]));
                ls[e >> 1] = __fadd_rn(ls[e >> 1], s[nt][e]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = fmaf(l[r], alpha[r], tca_quad_sum(ls[r]));
#pragma unroll
        for (int ot = 0; ot < OT; ++ot)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[ot][e] = __fmul_rn(o[ot][e], alpha[e >> 1]);
        tca_mma_tile<HD, TILE>(o, s, Vs, lane);   // o += P v
        __syncthreads();  // this stage is read: the next iteration may refill it
    }
    const long long row0 = ((long long)b * H + h) * T;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (lse != nullptr && t == 0 && rows[r] < T)
            lse[row0 + rows[r]] = __fadd_rn(m[r], logf(l[r]));
    tca_store<HD>(out + attn_head(b, h, H, T, hd, tok), o, rows, T, hd, attn_ld(H, hd, tok), l);
}

// dk, dv of 64 keys of one kv head, summed over the group's query heads (in order) and the
// query tiles that see them. The (head, query tile) pairs are one flat sequence, so the
// cp.async pipeline runs across head boundaries.
template <int HD, int TILE>
__device__ __forceinline__ void tca_bwd_dkdv(unsigned short* smem, float* dk, float* dv,
                                             const unsigned short* q, const unsigned short* k,
                                             const unsigned short* v, const unsigned short* gb,
                                             const float* lse, const float* delta,
                                             const int* segs, int H, int KV, int T, int hd,
                                             float scale, int causal, int window, int tok,
                                             int asis) {
    constexpr int LD = HD + TG_TCA_PAD, NT = TILE / 8, OT = HD / 8;
    const int kvh = blockIdx.y, b = blockIdx.z, G = H / KV;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int j0 = blockIdx.x * TG_TCA_BQ;
    const int tq = asis & 1, tk = (asis >> 1) & 1, tv = (asis >> 2) & 1, tg = (asis >> 3) & 1;
    if (segs != nullptr) segs += (long long)b * T;
    unsigned kf[HD / 16][4], vf[HD / 16][4];
    tca_stage_frags<HD>(kf, smem, k + attn_head(b, kvh, KV, T, HD, tk), j0, T, attn_ld(KV, HD, tk));
    tca_stage_frags<HD>(vf, smem, v + attn_head(b, kvh, KV, T, HD, tv), j0, T, attn_ld(KV, HD, tv));
    const int keys[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};
    float dka[OT][4], dva[OT][4];
    tca_zero<OT>(dka);
    tca_zero<OT>(dva);
    // The query tiles that see keys [j0, j0 + 64): from the tile of j0 (causal) to the tile
    // of the last key's last window query.
    const int nq = (T + TILE - 1) / TILE;
    const int qfirst = causal ? j0 / TILE : 0;
    const int qlast = window > 0 ? min(nq - 1, (min(j0 + TG_TCA_BQ, T) - 1 + window - 1) / TILE)
                                 : nq - 1;
    const int per_head = qlast - qfirst + 1, n = G * per_head;
    for (int it = -1; it < n; ++it) {
        if (it + 1 < n) {  // stage the next (head, query tile): q and dO
            const int h1 = kvh * G + (it + 1) / per_head;
            const int i1 = (qfirst + (it + 1) % per_head) * TILE;
            unsigned short* nx = smem + ((it + 1) & 1) * 2 * TILE * LD;
            tca_issue<HD, TILE>(nx, q + attn_head(b, h1, H, T, HD, tq), i1, T, attn_ld(H, HD, tq));
            tca_issue<HD, TILE>(nx + TILE * LD, gb + attn_head(b, h1, H, T, HD, tg), i1, T,
                                attn_ld(H, HD, tg));
            tg_cp_async_commit();
        }
        if (it < 0) continue;
        if (it + 1 < n) tg_cp_async_wait<1>();
        else tg_cp_async_wait<0>();
        __syncthreads();
        const int h = kvh * G + it / per_head, i0 = (qfirst + it % per_head) * TILE;
        const unsigned short* Qs = smem + (it & 1) * 2 * TILE * LD;
        const unsigned short* Gs = Qs + TILE * LD;
        float st[NT][4], dpt[NT][4];   // S^T = k q^T and dP^T = v dO^T, [key][query]
        tca_zero<NT>(st);
        tca_zero<NT>(dpt);
        tca_mma_nk<HD, NT>(st, kf, Qs, lane);
        tca_mma_nk<HD, NT>(dpt, vf, Gs, lane);
        const float* L = lse + ((long long)b * H + h) * T;
        const float* D = delta + ((long long)b * H + h) * T;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = i0 + nt * 8 + 2 * t + (e & 1);
                const bool seen = tca_sees(i, keys[e >> 1], segs, T, causal, window);
                const float p = seen ? expf(__fsub_rn(__fmul_rn(st[nt][e], scale), L[i])) : 0.0f;
                dpt[nt][e] = seen ? __fmul_rn(__fmul_rn(p, __fsub_rn(dpt[nt][e], D[i])), scale)
                                  : 0.0f;
                st[nt][e] = p;
            }
        tca_mma_tile<HD, TILE>(dva, st, Gs, lane);    // dv += P^T dO
        tca_mma_tile<HD, TILE>(dka, dpt, Qs, lane);   // dk += dS^T q
        __syncthreads();  // this stage is read: the next iteration may refill it
    }
    const long long at = attn_head(b, kvh, KV, T, hd, tok);
    tca_store<HD>(dk + at, dka, keys, T, hd, attn_ld(KV, hd, tok));
    tca_store<HD>(dv + at, dva, keys, T, hd, attn_ld(KV, hd, tok));
}

// dq of 64 queries of one head over the key tiles they see.
template <int HD, int TILE>
__device__ __forceinline__ void tca_bwd_dq(unsigned short* smem, float* dq,
                                           const unsigned short* q, const unsigned short* k,
                                           const unsigned short* v, const unsigned short* gb,
                                           const float* lse, const float* delta,
                                           const int* segs, int H, int KV, int T, int hd,
                                           float scale, int causal, int window, int tok,
                                           int asis) {
    constexpr int LD = HD + TG_TCA_PAD, NT = TILE / 8, OT = HD / 8;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int i0 = blockIdx.x * TG_TCA_BQ;
    const int tq = asis & 1, tk = (asis >> 1) & 1, tv = (asis >> 2) & 1, tg = (asis >> 3) & 1;
    const unsigned short* K = k + attn_head(b, kvh, KV, T, HD, tk);
    const unsigned short* V = v + attn_head(b, kvh, KV, T, HD, tv);
    const int ldk = attn_ld(KV, HD, tk), ldv = attn_ld(KV, HD, tv);
    if (segs != nullptr) segs += (long long)b * T;
    unsigned qf[HD / 16][4], gf[HD / 16][4];
    tca_stage_frags<HD>(qf, smem, q + attn_head(b, h, H, T, HD, tq), i0, T, attn_ld(H, HD, tq));
    tca_stage_frags<HD>(gf, smem, gb + attn_head(b, h, H, T, HD, tg), i0, T, attn_ld(H, HD, tg));
    const int rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    const long long row0 = ((long long)b * H + h) * T;
    float Lr[2], Dr[2], dqa[OT][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        Lr[r] = rows[r] < T ? lse[row0 + rows[r]] : 0.0f;
        Dr[r] = rows[r] < T ? delta[row0 + rows[r]] : 0.0f;
    }
    tca_zero<OT>(dqa);
    int first, last;
    tca_key_tiles(i0, TILE, T, causal, window, first, last);
    for (int kt = first - 1; kt <= last; ++kt) {
        if (!tca_key_tile_ready<HD, TILE>(smem, K, V, kt, first, last, T, ldk, ldv)) continue;
        const unsigned short* Ks = smem + ((kt - first) & 1) * 2 * TILE * LD;
        const unsigned short* Vs = Ks + TILE * LD;
        float s[NT][4], dp[NT][4];
        tca_zero<NT>(s);
        tca_zero<NT>(dp);
        tca_mma_nk<HD, NT>(s, qf, Ks, lane);
        tca_mma_nk<HD, NT>(dp, gf, Vs, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, j = kt * TILE + nt * 8 + 2 * t + (e & 1);
                const bool seen = tca_sees(rows[r], j, segs, T, causal, window);
                const float p = seen ? expf(__fsub_rn(__fmul_rn(s[nt][e], scale), Lr[r])) : 0.0f;
                s[nt][e] = seen ? __fmul_rn(__fmul_rn(p, __fsub_rn(dp[nt][e], Dr[r])), scale)
                                : 0.0f;
            }
        tca_mma_tile<HD, TILE>(dqa, s, Ks, lane);   // dq += dS k
        __syncthreads();  // this stage is read: the next iteration may refill it
    }
    tca_store<HD>(dq + attn_head(b, h, H, T, hd, tok), dqa, rows, T, hd, attn_ld(H, hd, tok));
}

// ---- conversions (grid-stride, any grid) ------------------------------------------------
// Where row r = (b * heads + h) * T + i of a heads-first copy starts in its f32 source of
// `heads` heads: the same row of a [B, heads, T, hd] source, or row i of head h of a
// token-major [B, T, heads, hd] one (tok = 1).
__device__ __forceinline__ long long tca_src_row(int r, int heads, int T, int hd, int tok) {
    const int bh = r / T;
    return tok ? attn_head(bh / heads, bh % heads, heads, T, hd, 1)
                     + (long long)(r % T) * attn_ld(heads, hd, 1)
               : (long long)r * hd;
}

// dst [rows, HD] bf16 (heads first) = src's rows rounded to nearest even (an f32 source;
// bit 0 of bf16: a bf16 one, copied), zeros past hd.
extern "C" __global__ void tg_tca_to_bf16(unsigned short* dst, const void* src, int rows,
                                          int hd, int HD, int heads, int T, int tok, int bf16) {
    TG_GRID_LOOP(x, rows * HD) {
        const int r = x / HD, d = x % HD;
        dst[x] = d < hd ? TcBF16::cvt(tg_ldx(src, tca_src_row(r, heads, T, hd, tok) + d, bf16, 0))
                        : (unsigned short)0;
    }
}

// Per row (heads first): D = rowsum(dO * o) in f32 (in order of d) and, unless gb is null
// (the kernels read dO as it lies), dO as padded bf16; o and dO in the operands' layout,
// o f32, dO f32 or (bit 1 of bf16) bf16.
extern "C" __global__ void tg_tca_bwd_prep(unsigned short* gb, float* delta, const float* o,
                                           const void* g, int rows, int hd, int HD, int heads,
                                           int T, int tok, int bf16) {
    TG_GRID_LOOP(r, rows) {
        const long long at = tca_src_row(r, heads, T, hd, tok);
        float acc = 0.0f;
        for (int d = 0; d < hd; ++d) {
            const float gd = tg_ldx(g, at + d, bf16, 1);
            acc = fmaf(gd, o[at + d], acc);
            if (gb != nullptr) gb[(long long)r * HD + d] = TcBF16::cvt(gd);
        }
        if (gb != nullptr)
            for (int d = hd; d < HD; ++d) gb[(long long)r * HD + d] = 0;
        delta[r] = acc;
    }
}

// ---- instantiations ---------------------------------------------------------------------
#define TG_TCA_FWD_ARGS                                                                    \
    float *out, float *lse, const unsigned short *q, const unsigned short *k,               \
        const unsigned short *v, const int *segs, const float *sinks, int H, int KV, int T,  \
        int hd, float scale, int causal, int window, int tok, int asis
#define TG_TCA_FWD_CALL \
    out, lse, q, k, v, segs, sinks, H, KV, T, hd, scale, causal, window, tok, asis

extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS) tg_tca_fwd_64(TG_TCA_FWD_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_64];
    tca_fwd<64, TG_TCA_TILE_64>(smem, TG_TCA_FWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS) tg_tca_fwd_128(TG_TCA_FWD_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_128];
    tca_fwd<128, TG_TCA_TILE_128>(smem, TG_TCA_FWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS) tg_tca_fwd_256(TG_TCA_FWD_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_256];
    tca_fwd<256, TG_TCA_TILE_256>(smem, TG_TCA_FWD_CALL);
}

#define TG_TCA_DKDV_ARGS                                                                   \
    float *dk, float *dv, const unsigned short *q, const unsigned short *k,                 \
        const unsigned short *v, const unsigned short *gb, const float *lse,                 \
        const float *delta, const int *segs, int H, int KV, int T, int hd, float scale,      \
        int causal, int window, int tok, int asis
#define TG_TCA_DQ_ARGS                                                                     \
    float *dq, const unsigned short *q, const unsigned short *k, const unsigned short *v,   \
        const unsigned short *gb, const float *lse, const float *delta, const int *segs,     \
        int H, int KV, int T, int hd, float scale, int causal, int window, int tok, int asis
#define TG_TCA_BWD_CALL \
    q, k, v, gb, lse, delta, segs, H, KV, T, hd, scale, causal, window, tok, asis

extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS)
tg_tca_bwd_dkdv_64(TG_TCA_DKDV_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_64];
    tca_bwd_dkdv<64, TG_TCA_TILE_64>(smem, dk, dv, TG_TCA_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS)
tg_tca_bwd_dkdv_128(TG_TCA_DKDV_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_128];
    tca_bwd_dkdv<128, TG_TCA_TILE_128>(smem, dk, dv, TG_TCA_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS)
tg_tca_bwd_dkdv_256(TG_TCA_DKDV_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_256];
    tca_bwd_dkdv<256, TG_TCA_TILE_256>(smem, dk, dv, TG_TCA_BWD_CALL);
}

extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS)
tg_tca_bwd_dq_64(TG_TCA_DQ_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_64];
    tca_bwd_dq<64, TG_TCA_TILE_64>(smem, dq, TG_TCA_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS)
tg_tca_bwd_dq_128(TG_TCA_DQ_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_128];
    tca_bwd_dq<128, TG_TCA_TILE_128>(smem, dq, TG_TCA_BWD_CALL);
}
extern "C" __global__ void __launch_bounds__(TG_TCA_THREADS)
tg_tca_bwd_dq_256(TG_TCA_DQ_ARGS) {
    __shared__ __align__(16) unsigned short smem[TG_TCA_SMEM_256];
    tca_bwd_dq<256, TG_TCA_TILE_256>(smem, dq, TG_TCA_BWD_CALL);
}
