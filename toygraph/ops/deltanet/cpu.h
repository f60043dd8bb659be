// The deltanet family's replay kernels (replay.h): the causal depthwise conv1d and the
// gated delta rule, forward and backward. Layouts as the ops': x, y [B, T, C], w [C, K];
// q, k [B, T, H, dk], v, o [B, T, H, dv], g, beta [B, T, H], states [B, H, dk, dv].

// --- causal depthwise conv1d -------------------------------------------------------------------

// w [C, K] as taps [K][C], so each tap's pass over a row of channels is unit-stride.
static std::vector<float> conv_taps(const float* w, int64_t C, int64_t K) {
    std::vector<float> taps((size_t)(K * C));
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < K; j++) taps[j * C + c] = w[c * K + j];
    return taps;
}

// Rows r0..r1 of a depthwise convolution over time of src [B * T, C] by taps [K][C]:
// y[r] = sum_j taps[j] src[r + dir (K - 1 - j)] over the taps whose row lies in the same
// sequence, tap by tap in j order, each product rounded and then added to the sum from 0,
// as the numpy kernels add their shifted slices: numpy's bits. dir -1 is the forward
// (tap j reads K - 1 - j steps back), +1 its gradient through x (the rows ahead).
static void conv_rows(float* out, const float* src, const float* taps, int64_t r0, int64_t r1,
                      int64_t T, int64_t C, int64_t K, int64_t dir) {
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r % T;
        float* y = out + r * C;
        for (int64_t c = 0; c < C; c++) y[c] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t s = t + dir * (K - 1 - j);
            if (s < 0 || s >= T) continue;
            const float *xs = src + (r - t + s) * C, *wj = taps + j * C;
            for (int64_t c = 0; c < C; c++) y[c] = y[c] + xs[c] * wj[c];
        }
    }
}

// y[b, t, c] = sum_j w[c, j] x[b, t - K + 1 + j, c], a task a run of (b, t) rows.
// p: out, x, w; i: B, T, C, K.
TG_REPLAY_KERNEL(causal_conv1d) {
    const int64_t B = n.i[0], T = n.i[1], C = n.i[2], K = n.i[3];
    const std::vector<float> taps = conv_taps((const float*)n.p[2], C, K);
    replay_for(B * T, C * K, [&](int64_t r0, int64_t r1) {
        conv_rows((float*)n.p[0], (const float*)n.p[1], taps.data(), r0, r1, T, C, K, -1);
    });
    return 0;
}

// Channels per task of the kernel gradient (its sums run over every (b, t) row).
static const int64_t kConvChannels = 64;

// Packed [dx (B*T*C), dw (C*K)]. dx[b, s, c] = sum_j w[c, j] g[b, s + K - 1 - j, c]
// (conv_rows: numpy's bits), a task a run of rows; dw[c, j] = sum over (b, t) of
// g[b, t, c] x[b, t - K + 1 + j, c], each product rounded to f32 as numpy's and summed in
// f64 in (b, t) order (numpy sums the axes in an order of its own), a task a run of
// channels. p: out, x, w, g; i: B, T, C, K.
TG_REPLAY_KERNEL(causal_conv1d_back) {
    float* dx = (float*)n.p[0];
    const float *x = (const float*)n.p[1], *g = (const float*)n.p[3];
    const int64_t B = n.i[0], T = n.i[1], C = n.i[2], K = n.i[3];
    float* dw = dx + B * T * C;
    const std::vector<float> taps = conv_taps((const float*)n.p[2], C, K);
    replay_for(B * T, C * K, [&](int64_t r0, int64_t r1) {
        conv_rows(dx, g, taps.data(), r0, r1, T, C, K, +1);
    });
    const int64_t tasks = (C + kConvChannels - 1) / kConvChannels;
    pool_for(tasks, [&](int64_t task, int) {
        const int64_t c0 = task * kConvChannels, cn = C - c0 < kConvChannels ? C - c0 : kConvChannels;
        std::vector<double> acc((size_t)(K * cn), 0.0);   // [K][cn]
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                const float* gt = g + (b * T + t) * C + c0;
                for (int64_t j = 0; j < K; j++) {
                    const int64_t lag = K - 1 - j;
                    if (lag > t) continue;
                    const float* xs = x + (b * T + t - lag) * C + c0;
                    double* a = acc.data() + j * cn;
                    for (int64_t c = 0; c < cn; c++) a[c] += (double)(gt[c] * xs[c]);
                }
            }
        for (int64_t c = 0; c < cn; c++)
            for (int64_t j = 0; j < K; j++) dw[(c0 + c) * K + j] = (float)acc[j * cn + c];
    });
    return 0;
}

// --- the gated delta rule ----------------------------------------------------------------------
// The chunked (WY) form, as the numpy kernels and deltanet.cu compute it. A chunk of n <= C
// steps from the state S0 [dk][dv], with cg the log decay from the chunk start (cumsum of
// g), gam_i = exp(cg_i), cdec_i = exp(cg_{n-1} - cg_i), D_il = exp(cg_i - cg_l) (l <= i):
//   P = strictly_lower(D * K K^T),  M = lower(D * Q K^T),  A = diag(beta) P
//   U = (I + A)^-1 diag(beta) (V - diag(gam) K S0)          (the chunk's new values)
//   O = diag(gam) Q S0 + M U,   S1 = gam_{n-1} S0 + (diag(cdec) K)^T U
// The backward is deltanet.cu's closed form per chunk (its comment derives each line),
// from the last chunk, carrying dS, the gradient of the state after the chunk.
//
// A task is one (b, h): its chunks run in order on one thread, every product a small GEMM
// of gemm.h's micro-kernel on the task's scratch (a matrix read as a GEMM's right operand
// has rows padded to whole strips of NR, as the micro-kernel reads them). A task's sums
// run in an order fixed by the shapes, so no thread count changes a bit.

static inline int64_t dn_pad(int64_t n) { return (n + NR - 1) / NR * NR; }

// C[M, N] = A[M, K] . B[K, N] (accumulate: C +=, continuing C's chains) on this thread;
// A's rows lda apart, B's ldb apart and readable to a whole strip past N.
static void dn_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
        if (!accumulate)
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < N; j++) C[m * ldc + j] = 0.0f;
        return;
    }
    for (int64_t n0 = 0; n0 < N; n0 += NR)
        rows_times_panel(M, K, A, lda, B + n0, ldb, C + n0, ldc, !accumulate,
                         (int)(N - n0 < NR ? N - n0 : NR));
}

// dst [cols][rows] (rows ldd apart) = src [rows][cols]^T (rows lds apart), by tiles of
// 16 x 16: a state's rows lie a power of two apart, and a column written whole would map
// every store to the same few cache sets.
static void dn_transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                         int64_t ldd) {
    const int64_t tile = 16;
    for (int64_t i0 = 0; i0 < rows; i0 += tile)
        for (int64_t j0 = 0; j0 < cols; j0 += tile) {
            const int64_t i1 = i0 + tile < rows ? i0 + tile : rows;
            const int64_t j1 = j0 + tile < cols ? j0 + tile : cols;
            for (int64_t j = j0; j < j1; j++)
                for (int64_t i = i0; i < i1; i++) dst[j * ldd + i] = src[i * lds + j];
        }
}

// The sum of a[j] b[j] over n in f64 (the scalar sums of the backward: a handful per row,
// and one over the state): in 8 lanes (j mod 8), so the adds do not wait on each other,
// then the lanes' sums in order.
static inline double dn_dot(const float* a, const float* b, int64_t n) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)a[j + l] * (double)b[j + l];
    for (; j < n; j++) lane[j % 8] += (double)a[j] * (double)b[j];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// The operands of a delta_rule node. p: out, q, k, v, g, beta, then the initial state or
// do (or null); i: B, T, H, dk, dv, chunk.
struct DeltaOps {
    float* out;
    const float *q, *k, *v, *g, *beta, *extra;
    int64_t B, T, H, dk, dv, C;

    // The row of step t of (b, h) in [B, T, H, ...] (times dk or dv for q, k, v, o).
    int64_t row(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * H + h; }
};

static DeltaOps delta_ops_of(const ReplayNode& n) {
    DeltaOps o;
    o.out = (float*)n.p[0];
    o.q = (const float*)n.p[1]; o.k = (const float*)n.p[2]; o.v = (const float*)n.p[3];
    o.g = (const float*)n.p[4]; o.beta = (const float*)n.p[5]; o.extra = (const float*)n.p[6];
    o.B = n.i[0]; o.T = n.i[1]; o.H = n.i[2]; o.dk = n.i[3]; o.dv = n.i[4];
    o.C = n.i[5] < o.T ? n.i[5] : o.T;   // a chunk past T is one chunk of T: the same math
    return o;
}

// One task's working set, carved from its scratch. Sizes: [C] vectors, [C][ldk] and
// [C][ldv] rows of a chunk, [C][ldn] chunk-by-chunk matrices, [dk][ldv] states and
// [dk][ldn] / [dv][ldk] transposes.
struct DeltaWork {
    int64_t ldk, ldv, ldn;
    float *q, *k, *v, *g, *beta, *cg, *gam, *cdec, *row;     // the chunk and its decays
    float *D, *P, *M, *kt, *KS, *QS, *U, *kdt, *S;           // the forward's
    float *dO, *KdS, *MT, *dR, *AT, *UT, *dM, *dA, *DM, *EE;   // the backward's
    float *S0T, *dST, *t1, *t2, *dS, *dSn, *qg, *kgb, *starts;
};

// Carves ``w`` from ``base`` (null: only counts) and returns the floats it takes; the
// backward's buffers and ``chunks`` start states only when ``backward``.
static size_t delta_carve(DeltaWork& w, float* base, const DeltaOps& o, bool backward,
                          int64_t chunks) {
    const int64_t C = o.C, dk = o.dk, dv = o.dv;
    w.ldk = dn_pad(dk); w.ldv = dn_pad(dv); w.ldn = dn_pad(C);
    size_t used = 0;
    auto take = [&](int64_t floats) {
        float* p = base ? base + used : nullptr;
        used += (size_t)floats;
        return p;
    };
    const int64_t vec = C, rk = C * w.ldk, rv = C * w.ldv, mat = C * w.ldn, st = dk * w.ldv;
    w.q = take(rk); w.k = take(rk); w.v = take(rv);
    w.g = take(vec); w.beta = take(vec); w.cg = take(vec); w.gam = take(vec); w.cdec = take(vec);
    w.row = take(w.ldv + w.ldn);
    w.D = take(mat); w.P = take(mat); w.M = take(mat); w.kt = take(dk * w.ldn);
    w.KS = take(rv); w.QS = take(rv); w.U = take(rv); w.kdt = take(dk * w.ldn); w.S = take(st);
    if (backward) {
        w.dO = take(rv); w.KdS = take(rv); w.MT = take(mat); w.dR = take(rv); w.AT = take(mat);
        w.UT = take(dv * w.ldn); w.dM = take(mat); w.dA = take(mat); w.DM = take(mat);
        w.EE = take(mat); w.S0T = take(dv * w.ldk); w.dST = take(dv * w.ldk);
        w.t1 = take(rk); w.t2 = take(rk); w.dS = take(st); w.dSn = take(st);
        w.qg = take(dk * w.ldn); w.kgb = take(dk * w.ldn); w.starts = take(chunks * st);
    }
    return used;
}

// The chunk of n steps from t0 of (b, h) from the state S0 [dk][ldv]: its rows gathered,
// its decays, D, P, M, K S0, Q S0 and U (the substitution row by row: U_i -= beta_i
// P[i, :i] U[:i]).
static void delta_prepare(const DeltaOps& o, DeltaWork& w, int64_t b, int64_t h, int64_t t0,
                          int64_t n, const float* S0) {
    const int64_t dk = o.dk, dv = o.dv, ldk = w.ldk, ldv = w.ldv, ldn = w.ldn;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = o.row(b, t0 + i, h);
        memcpy(w.q + i * ldk, o.q + r * dk, (size_t)dk * 4);
        memcpy(w.k + i * ldk, o.k + r * dk, (size_t)dk * 4);
        memcpy(w.v + i * ldv, o.v + r * dv, (size_t)dv * 4);
        w.g[i] = o.g[r];
        w.beta[i] = o.beta[r];
    }
    float acc = 0.0f;   // numpy's cumsum: one f32 sum in step order
    for (int64_t i = 0; i < n; i++) w.cg[i] = acc = acc + w.g[i];
    for (int64_t i = 0; i < n; i++) {
        w.gam[i] = expf(w.cg[i]);
        w.cdec[i] = expf(w.cg[n - 1] - w.cg[i]);
    }
    for (int64_t i = 0; i < n; i++) {
        float* d = w.D + i * ldn;
        for (int64_t l = 0; l <= i; l++) w.row[l] = w.cg[i] - w.cg[l];
        vf_apply(d, w.row, i + 1, [](vf s) { return vf_exp(s); });
        for (int64_t l = i + 1; l < n; l++) d[l] = 0.0f;
    }
    dn_transpose(n, dk, w.k, ldk, w.kt, ldn);
    dn_gemm(n, n, dk, w.k, ldk, w.kt, ldn, w.P, ldn, false);
    dn_gemm(n, n, dk, w.q, ldk, w.kt, ldn, w.M, ldn, false);
    for (int64_t i = 0; i < n; i++)
        for (int64_t l = 0; l < n; l++) {
            const float d = w.D[i * ldn + l];
            w.P[i * ldn + l] = l < i ? d * w.P[i * ldn + l] : 0.0f;
            w.M[i * ldn + l] = l <= i ? d * w.M[i * ldn + l] : 0.0f;
        }
    dn_gemm(n, dv, dk, w.k, ldk, S0, ldv, w.KS, ldv, false);
    dn_gemm(n, dv, dk, w.q, ldk, S0, ldv, w.QS, ldv, false);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < dv; j++)
            w.U[i * ldv + j] = w.beta[i] * (w.v[i * ldv + j] - w.gam[i] * w.KS[i * ldv + j]);
    for (int64_t i = 1; i < n; i++) {
        dn_gemm(1, dv, i, w.P + i * ldn, ldn, w.U, ldv, w.row, ldv, false);
        for (int64_t j = 0; j < dv; j++) w.U[i * ldv + j] = w.U[i * ldv + j] - w.beta[i] * w.row[j];
    }
}

// dst [cols][n] (rows ldd apart) = (diag(s) src)^T, src [n][cols] rows lds apart: K^T or Q^T
// with each step's column scaled.
static void dn_scaled_transpose(int64_t n, int64_t cols, const float* src, int64_t lds,
                                const float* s, float* dst, int64_t ldd) {
    dn_transpose(n, cols, src, lds, dst, ldd);
    for (int64_t d = 0; d < cols; d++)
        for (int64_t i = 0; i < n; i++) dst[d * ldd + i] = s[i] * dst[d * ldd + i];
}

// S = gam_{n-1} S + (diag(cdec) K)^T U: the state after the chunk, in place.
static void delta_advance(const DeltaOps& o, DeltaWork& w, int64_t n, float* S) {
    const int64_t dk = o.dk, dv = o.dv;
    dn_scaled_transpose(n, dk, w.k, w.ldk, w.cdec, w.kdt, w.ldn);
    const float last = w.gam[n - 1];
    for (int64_t d = 0; d < dk; d++)
        for (int64_t j = 0; j < dv; j++) S[d * w.ldv + j] = last * S[d * w.ldv + j];
    dn_gemm(dk, dv, n, w.kdt, w.ldn, w.U, w.ldv, S, w.ldv, true);
}

// o [B, T, H, dv], then with an initial state the state after the last step [B, H, dk,
// dv]. p: out, q, k, v, g, beta, state or null; i: B, T, H, dk, dv, chunk.
TG_REPLAY_KERNEL(delta_rule) {
    const DeltaOps o = delta_ops_of(n);
    if (o.C < 1 && o.T > 0) return -1;
    DeltaWork probe;
    const size_t floats = delta_carve(probe, nullptr, o, false, 0);
    pool_for(o.B * o.H, [&](int64_t task, int) {
        const int64_t b = task / o.H, h = task % o.H;
        DeltaWork w;
        float* base = replay_scratch(floats);
        delta_carve(w, base, o, false, 0);
        memset(base, 0, floats * 4);   // zeros where the GEMMs read past a row's end
        const float* S0 = o.extra ? o.extra + task * o.dk * o.dv : nullptr;
        for (int64_t d = 0; d < o.dk; d++)
            for (int64_t j = 0; j < o.dv; j++) w.S[d * w.ldv + j] = S0 ? S0[d * o.dv + j] : 0.0f;
        for (int64_t t0 = 0; t0 < o.T; t0 += o.C) {
            const int64_t m = o.T - t0 < o.C ? o.T - t0 : o.C;
            delta_prepare(o, w, b, h, t0, m, w.S);
            // O = diag(gam) Q S0 + M U (M U into KS, no longer needed)
            dn_gemm(m, o.dv, m, w.M, w.ldn, w.U, w.ldv, w.KS, w.ldv, false);
            for (int64_t i = 0; i < m; i++) {
                float* y = o.out + o.row(b, t0 + i, h) * o.dv;
                for (int64_t j = 0; j < o.dv; j++)
                    y[j] = w.gam[i] * w.QS[i * w.ldv + j] + w.KS[i * w.ldv + j];
            }
            delta_advance(o, w, m, w.S);
        }
        if (o.extra) {
            float* Sf = o.out + o.B * o.T * o.H * o.dv + task * o.dk * o.dv;
            for (int64_t d = 0; d < o.dk; d++)
                for (int64_t j = 0; j < o.dv; j++) Sf[d * o.dv + j] = w.S[d * w.ldv + j];
        }
    });
    return 0;
}

// One chunk's backward (deltanet.cu's tg_delta_chunked_back, line for line in matrix
// form), the chunk prepared from its start state S0; reads dS (the gradient of the state
// after the chunk) and leaves the gradient of S0 in dSn. ``dcg``: 2n doubles of scratch.
static void delta_chunk_back(const DeltaOps& o, DeltaWork& w, int64_t b, int64_t h, int64_t t0,
                             int64_t n, const float* S0, double* dcg) {
    const int64_t dk = o.dk, dv = o.dv, ldk = w.ldk, ldv = w.ldv, ldn = w.ldn;
    const int64_t BTH = o.B * o.T * o.H;
    float *dq = o.out, *dkk = dq + BTH * dk, *dvv = dkk + BTH * dk, *dg = dvv + BTH * dv;
    float* dbeta = dg + BTH;
    const float* dout = o.extra;
    for (int64_t i = 0; i < n; i++)
        memcpy(w.dO + i * ldv, dout + o.row(b, t0 + i, h) * dv, (size_t)dv * 4);
    // dU = M^T dO + diag(cdec) K dS, then (I + A)^T dR = dU from the last row up
    dn_gemm(n, dv, dk, w.k, ldk, w.dS, ldv, w.KdS, ldv, false);
    dn_transpose(n, n, w.M, ldn, w.MT, ldn);
    dn_gemm(n, dv, n, w.MT, ldn, w.dO, ldv, w.dR, ldv, false);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < dv; j++)
            w.dR[i * ldv + j] = w.dR[i * ldv + j] + w.cdec[i] * w.KdS[i * ldv + j];
    for (int64_t i = 0; i < n; i++)   // AT[i][l] = A[l][i] = beta_l P[l][i], l > i
        for (int64_t l = 0; l < n; l++)
            w.AT[i * ldn + l] = l > i ? w.beta[l] * w.P[l * ldn + i] : 0.0f;
    for (int64_t i = n - 2; i >= 0; i--) {
        dn_gemm(1, dv, n - 1 - i, w.AT + i * ldn + i + 1, ldn, w.dR + (i + 1) * ldv, ldv, w.row,
                ldv, false);
        for (int64_t j = 0; j < dv; j++) w.dR[i * ldv + j] = w.dR[i * ldv + j] - w.row[j];
    }
    // dM = lower(dO U^T), dA = -strictly_lower(dR U^T); D-weighted: DM = dM D,
    // EE = E + E^T with E = diag(beta) dA D
    dn_transpose(n, dv, w.U, ldv, w.UT, ldn);
    dn_gemm(n, n, dv, w.dO, ldv, w.UT, ldn, w.dM, ldn, false);
    dn_gemm(n, n, dv, w.dR, ldv, w.UT, ldn, w.dA, ldn, false);
    for (int64_t i = 0; i < n; i++)
        for (int64_t l = 0; l < n; l++) {
            const int64_t il = i * ldn + l;
            w.dM[il] = l <= i ? w.dM[il] : 0.0f;
            w.dA[il] = l < i ? -w.dA[il] : 0.0f;
            w.DM[il] = w.dM[il] * w.D[il];
            w.EE[il] = w.beta[i] * w.dA[il] * w.D[il];   // E, then E + E^T below
        }
    for (int64_t i = 0; i < n; i++)
        for (int64_t l = 0; l < i; l++) {
            const float sum = w.EE[i * ldn + l] + w.EE[l * ldn + i];
            w.EE[i * ldn + l] = w.EE[l * ldn + i] = sum;
        }
    // dq = diag(gam) dO S0^T + DM K
    dn_transpose(dk, dv, S0, ldv, w.S0T, ldk);
    dn_gemm(n, dk, dv, w.dO, ldv, w.S0T, ldk, w.t1, ldk, false);
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < dk; d++) w.t1[i * ldk + d] = w.gam[i] * w.t1[i * ldk + d];
    dn_gemm(n, dk, n, w.DM, ldn, w.k, ldk, w.t1, ldk, true);
    for (int64_t i = 0; i < n; i++)
        memcpy(dq + o.row(b, t0 + i, h) * dk, w.t1 + i * ldk, (size_t)dk * 4);
    // dk = DM^T Q + EE K + diag(cdec) U dS^T - diag(gam beta) dR S0^T (DM^T into MT)
    dn_transpose(n, n, w.DM, ldn, w.MT, ldn);
    dn_gemm(n, dk, n, w.MT, ldn, w.q, ldk, w.t1, ldk, false);
    dn_gemm(n, dk, n, w.EE, ldn, w.k, ldk, w.t1, ldk, true);
    dn_transpose(dk, dv, w.dS, ldv, w.dST, ldk);
    dn_gemm(n, dk, dv, w.U, ldv, w.dST, ldk, w.t2, ldk, false);
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < dk; d++)
            w.t1[i * ldk + d] = w.t1[i * ldk + d] + w.cdec[i] * w.t2[i * ldk + d];
    dn_gemm(n, dk, dv, w.dR, ldv, w.S0T, ldk, w.t2, ldk, false);
    for (int64_t i = 0; i < n; i++) {
        const float gb = w.gam[i] * w.beta[i];
        float* y = dkk + o.row(b, t0 + i, h) * dk;
        for (int64_t d = 0; d < dk; d++) y[d] = w.t1[i * ldk + d] - gb * w.t2[i * ldk + d];
    }
    // dv = diag(beta) dR
    for (int64_t i = 0; i < n; i++) {
        float* y = dvv + o.row(b, t0 + i, h) * dv;
        for (int64_t j = 0; j < dv; j++) y[j] = w.beta[i] * w.dR[i * ldv + j];
    }
    // dbeta_i = dR_i.(v_i - gam_i KS_i) + dA_i.P_i; d cg_i = rowsum_i(F) - colsum_i(F) +
    // gam_i (dO_i.QS_i - beta_i dR_i.KS_i) - cdec_i U_i.KdS_i, F = dM * M + dA * A; and
    // at i = n-1 also the sums of cdec_l U_l.KdS_l and gam_{n-1} sum(dS * S0)
    double last = 0.0, dss = 0.0;
    double* colF = dcg + n;   // colsum_l(F), rows added in order
    for (int64_t l = 0; l < n; l++) colF[l] = 0.0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t l = 0; l < n; l++) {
            const int64_t il = i * ldn + l;
            colF[l] += (double)w.dM[il] * w.M[il] + (double)w.dA[il] * w.beta[i] * w.P[il];
        }
    for (int64_t i = 0; i < n; i++) {
        const double rk = dn_dot(w.dR + i * ldv, w.KS + i * ldv, dv);
        const double rv = dn_dot(w.dR + i * ldv, w.v + i * ldv, dv);
        double pa = 0.0, fa = 0.0;
        const double fb = colF[i];
        for (int64_t l = 0; l < n; l++) {
            const int64_t il = i * ldn + l;
            pa += (double)w.dA[il] * w.P[il];
            fa += (double)w.dM[il] * w.M[il] + (double)w.dA[il] * w.beta[i] * w.P[il];
        }
        dbeta[o.row(b, t0 + i, h)] = (float)(rv - (double)w.gam[i] * rk + pa);
        const double uk = (double)w.cdec[i] * dn_dot(w.U + i * ldv, w.KdS + i * ldv, dv);
        const double og = dn_dot(w.dO + i * ldv, w.QS + i * ldv, dv);
        dcg[i] = fa - fb + (double)w.gam[i] * (og - (double)w.beta[i] * rk) - uk;
        last += uk;
    }
    for (int64_t d = 0; d < dk; d++) dss += dn_dot(w.dS + d * ldv, S0 + d * ldv, dv);
    dcg[n - 1] += last + (double)w.gam[n - 1] * dss;
    double acc = 0.0;   // dg: the running sum of d cg from the chunk's end
    for (int64_t i = n - 1; i >= 0; i--) dg[o.row(b, t0 + i, h)] = (float)(acc += dcg[i]);
    // dS0 = gam_{n-1} dS + Q^T diag(gam) dO - K^T diag(gam beta) dR
    for (int64_t i = 0; i < n; i++) w.row[i] = -(w.gam[i] * w.beta[i]);
    dn_scaled_transpose(n, dk, w.q, ldk, w.gam, w.qg, ldn);
    dn_scaled_transpose(n, dk, w.k, ldk, w.row, w.kgb, ldn);
    for (int64_t d = 0; d < dk; d++)
        for (int64_t j = 0; j < dv; j++) w.dSn[d * ldv + j] = w.gam[n - 1] * w.dS[d * ldv + j];
    dn_gemm(dk, dv, n, w.qg, ldn, w.dO, ldv, w.dSn, ldv, true);
    dn_gemm(dk, dv, n, w.kgb, ldn, w.dR, ldv, w.dSn, ldv, true);
}

// Packed [dq, dk, dv, dg, dbeta] in the sources' layouts: per (b, h) the state at each
// chunk start by the forward, then each chunk's backward from the last, carrying dS.
// p: out, q, k, v, g, beta, do; i: B, T, H, dk, dv, chunk.
TG_REPLAY_KERNEL(delta_rule_back) {
    const DeltaOps o = delta_ops_of(n);
    if (o.C < 1 && o.T > 0) return -1;
    if (o.T == 0) return 0;
    const int64_t chunks = (o.T + o.C - 1) / o.C;
    DeltaWork probe;
    const size_t floats = delta_carve(probe, nullptr, o, true, chunks);
    pool_for(o.B * o.H, [&](int64_t task, int) {
        const int64_t b = task / o.H, h = task % o.H, plane = o.dk * (dn_pad(o.dv));
        DeltaWork w;
        float* base = replay_scratch(floats);
        delta_carve(w, base, o, true, chunks);
        // zeros where the GEMMs read past a row's end (the pads) and the first start state
        memset(base, 0, (size_t)(w.starts - base + plane) * 4);
        std::vector<double> dcg((size_t)(2 * o.C));
        for (int64_t c = 0; c + 1 < chunks; c++) {
            float* S = w.starts + c * plane;
            delta_prepare(o, w, b, h, c * o.C, o.C, S);
            memcpy(S + plane, S, (size_t)plane * 4);
            delta_advance(o, w, o.C, S + plane);
        }
        for (int64_t c = chunks - 1; c >= 0; c--) {
            const int64_t t0 = c * o.C, m = o.T - t0 < o.C ? o.T - t0 : o.C;
            const float* S0 = w.starts + c * plane;
            delta_prepare(o, w, b, h, t0, m, S0);
            delta_chunk_back(o, w, b, h, t0, m, S0, dcg.data());
            std::swap(w.dS, w.dSn);
        }
    });
    return 0;
}
