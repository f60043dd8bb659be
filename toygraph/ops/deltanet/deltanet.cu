// The Gated DeltaNet ops (ops/deltanet/): the causal depthwise conv1d and the gated delta
// rule, forward and backward. Layouts: x, y [B, T, C], w [C, K]; q, k [B, T, H, dk],
// v, o [B, T, H, dv], g, beta [B, T, H], states [B, H, dk, dv].

// y[b, t, c] = sum_j w[c, j] x[b, t - K + 1 + j, c], taps in order j = 0..K-1.
extern "C" __global__ void tg_causal_conv1d(float* out, const float* x, const float* w, int B,
                                            int T, int C, int K) {
    TG_GRID_LOOP(i, B * T * C) {
        int c = i % C, t = (i / C) % T;
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            int s = t - (K - 1) + j;
            if (s >= 0) acc = __fadd_rn(acc, __fmul_rn(x[i + (s - t) * C], w[c * K + j]));
        }
        out[i] = acc;
    }
}

// Packed [dx (B*T*C), dw (C*K)]: one thread per element of either.
extern "C" __global__ void tg_causal_conv1d_back(float* out, const float* x, const float* w,
                                                 const float* g, int B, int T, int C, int K) {
    int nx = B * T * C;
    TG_GRID_LOOP(i, nx + C * K) {
        float acc = 0.0f;
        if (i < nx) {      // dx[b, s, c] = sum_j w[c, j] g[b, s + K - 1 - j, c]
            int c = i % C, s = (i / C) % T;
            for (int j = 0; j < K; ++j) {
                int t = s + (K - 1) - j;
                if (t < T) acc = __fadd_rn(acc, __fmul_rn(g[i + (t - s) * C], w[c * K + j]));
            }
        } else {           // dw[c, j] = sum_{b, t} g[b, t, c] x[b, t - K + 1 + j, c]
            int c = (i - nx) / K, j = (i - nx) % K, lag = K - 1 - j;
            for (int b = 0; b < B; ++b)
                for (int t = lag; t < T; ++t)
                    acc = __fadd_rn(acc, __fmul_rn(g[(b * T + t) * C + c],
                                                   x[(b * T + t - lag) * C + c]));
        }
        out[i] = acc;
    }
}

// One step of column j of the state, s[0..dk) = S[:, j]: decay by a, write the delta of
// (v_j - (a S)^T k) scaled by beta, read o_j = S^T q. Returns o_j; err = v_j - (a S)^T k.
__device__ __forceinline__ float tg_delta_step(float* s, const float* q, const float* k,
                                               float vj, float a, float beta, int dk,
                                               float& err) {
    float kvm = 0.0f;
    for (int i = 0; i < dk; ++i) {
        s[i] = __fmul_rn(s[i], a);
        kvm = __fadd_rn(kvm, __fmul_rn(s[i], k[i]));
    }
    err = __fsub_rn(vj, kvm);
    float d = __fmul_rn(beta, err), o = 0.0f;
    for (int i = 0; i < dk; ++i) {
        s[i] = __fadd_rn(s[i], __fmul_rn(k[i], d));
        o = __fadd_rn(o, __fmul_rn(s[i], q[i]));
    }
    return o;
}

// Step-wise forward (decoding, T == 1): one thread per (b, h, column j), sequential in time.
// `state` (nullable) is the initial state; with_state also writes the final state after o.
extern "C" __global__ void tg_delta_rule(float* out, const float* q, const float* k,
                                         const float* v, const float* g, const float* beta,
                                         const float* state, int B, int T, int H, int dk,
                                         int dv, int with_state) {
    float s[TG_DELTA_MAX_DK];
    TG_GRID_LOOP(n, B * H * dv) {
        int j = n % dv, h = (n / dv) % H, b = n / (dv * H);
        const float* s0 = state + (size_t)(b * H + h) * dk * dv + j;
        for (int i = 0; i < dk; ++i) s[i] = with_state ? s0[i * dv] : 0.0f;
        for (int t = 0; t < T; ++t) {
            int bth = (b * T + t) * H + h;
            float err;
            out[bth * dv + j] = tg_delta_step(s, q + bth * dk, k + bth * dk, v[bth * dv + j],
                                              expf(g[bth]), beta[bth], dk, err);
        }
        if (with_state) {
            float* sf = out + (size_t)B * T * H * dv + (size_t)(b * H + h) * dk * dv + j;
            for (int i = 0; i < dk; ++i) sf[i * dv] = s[i];
        }
    }
}

// --- the chunked (WY) form: training, evaluation and prefill --------------------------------
// A chunk of n <= C steps from the state S0 [dk][dv], with cg the log decay from the chunk
// start (cumsum of g), gam_i = exp(cg_i), D_il = exp(cg_i - cg_l) (l <= i):
//   P = strictly_lower(D * K K^T),  M = lower(D * Q K^T),  A = diag(beta) P
//   U = (I + A)^-1 diag(beta) (V - diag(gam) K S0)          (the chunk's new values)
//   O = diag(gam) Q S0 + M U,   S1 = gam_{n-1} S0 + (diag(gam_{n-1} / gam) K)^T U
// The unit lower-triangular system is solved by substitution, one thread per column of U;
// every other step is a product spread over the whole block. One block of TG_THREADS
// threads per (b, h), walking the chunks in order; the per-(b, h) matrices live in scratch
// (ChunkBufs); no float atomics, so every result is bit-identical run to run.

__device__ __forceinline__ float tg_delta_dot(const float* a, int sa, const float* b, int sb,
                                              int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc = __fadd_rn(acc, __fmul_rn(a[i * sa], b[i * sb]));
    return acc;
}

struct ChunkBufs {   // one (b, h)'s working set: [C][C] matrices and [C][dv] rows
    float *D, *P, *M, *KS, *QS, *U;
};

__device__ __forceinline__ ChunkBufs tg_delta_bufs(float* at, int C, int dv) {
    ChunkBufs w;
    w.D = at, w.P = at + C * C, w.M = at + 2 * C * C;
    w.KS = at + 3 * C * C, w.QS = w.KS + C * dv, w.U = w.QS + C * dv;
    return w;
}

// The chunk's decays (shared cg, gam, cdec = exp(cg_{n-1} - cg)), D, P, M, K S0, Q S0 and U.
// Every thread of the block calls it; it returns after a barrier.
__device__ void tg_delta_prepare(const float* q, const float* k, const float* v,
                                 const float* g, const float* beta, const float* S0,
                                 ChunkBufs w, float* cg, float* gam, float* cdec, int b, int h,
                                 int t0, int n, int C, int T, int H, int dk, int dv) {
    int tid = threadIdx.x, nt = blockDim.x, row0 = (b * T + t0) * H + h;   // step i: row0 + i H
    if (tid == 0) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) cg[i] = acc = __fadd_rn(acc, g[row0 + i * H]);
        for (int i = 0; i < n; ++i) gam[i] = expf(cg[i]), cdec[i] = expf(cg[n - 1] - cg[i]);
    }
    __syncthreads();
    for (int x = tid; x < n * n; x += nt) {
        int i = x / n, l = x % n;
        const float *qi = q + (size_t)(row0 + i * H) * dk, *ki = k + (size_t)(row0 + i * H) * dk;
        const float* kl = k + (size_t)(row0 + l * H) * dk;
        float d = l <= i ? expf(cg[i] - cg[l]) : 0.0f;
        w.D[i * C + l] = d;
        w.P[i * C + l] = l < i ? __fmul_rn(d, tg_delta_dot(ki, 1, kl, 1, dk)) : 0.0f;
        w.M[i * C + l] = l <= i ? __fmul_rn(d, tg_delta_dot(qi, 1, kl, 1, dk)) : 0.0f;
    }
    for (int x = tid; x < n * dv; x += nt) {
        int i = x / dv, j = x % dv, r = row0 + i * H;
        float ks = tg_delta_dot(k + (size_t)r * dk, 1, S0 + j, dv, dk);
        w.KS[i * dv + j] = ks;
        w.QS[i * dv + j] = tg_delta_dot(q + (size_t)r * dk, 1, S0 + j, dv, dk);
        w.U[i * dv + j] = __fmul_rn(beta[r], __fsub_rn(v[(size_t)r * dv + j], __fmul_rn(gam[i], ks)));
    }
    __syncthreads();
    for (int j = tid; j < dv; j += nt)          // (I + diag(beta) P) U = R, row by row
        for (int i = 1; i < n; ++i) {
            float bi = beta[row0 + i * H], acc = 0.0f;
            for (int l = 0; l < i; ++l) acc = __fadd_rn(acc, __fmul_rn(w.P[i * C + l], w.U[l * dv + j]));
            w.U[i * dv + j] = __fsub_rn(w.U[i * dv + j], __fmul_rn(bi, acc));
        }
    __syncthreads();
}

// S1 = gam_{n-1} S0 + sum_i cdec_i k_i U_i^T, written to S1 (may be S0: each element is
// read and written by one thread only). Returns after a barrier.
__device__ void tg_delta_advance(const float* k, ChunkBufs w, const float* S0, float* S1,
                                 const float* gam, const float* cdec, int row0, int n, int H,
                                 int dk, int dv) {
    for (int x = threadIdx.x; x < dk * dv; x += blockDim.x) {
        int d = x / dv, j = x % dv;
        float acc = __fmul_rn(gam[n - 1], S0[x]);
        for (int i = 0; i < n; ++i)
            acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(cdec[i], k[(size_t)(row0 + i * H) * dk + d]),
                                           w.U[i * dv + j]));
        S1[x] = acc;
    }
    __syncthreads();
}

// Forward: o [B, T, H, dv], then (with_state) the final states. `state` (read if with_state)
// is the initial state. Scratch per (b, h): S [dk][dv], then the ChunkBufs.
extern "C" __global__ void tg_delta_chunked(float* out, const float* q, const float* k,
                                            const float* v, const float* g, const float* beta,
                                            const float* state, float* scratch, int B, int T,
                                            int H, int dk, int dv, int C, int with_state) {
    __shared__ float cg[TG_DELTA_CHUNK], gam[TG_DELTA_CHUNK], cdec[TG_DELTA_CHUNK];
    int bh = blockIdx.x, b = bh / H, h = bh % H, plane = dk * dv;
    float* S = scratch + (size_t)bh * (plane + 3 * C * C + 3 * C * dv);
    ChunkBufs w = tg_delta_bufs(S + plane, C, dv);
    for (int x = threadIdx.x; x < plane; x += blockDim.x)
        S[x] = with_state ? state[(size_t)bh * plane + x] : 0.0f;
    __syncthreads();
    for (int t0 = 0; t0 < T; t0 += C) {
        int n = min(C, T - t0), row0 = (b * T + t0) * H + h;
        tg_delta_prepare(q, k, v, g, beta, S, w, cg, gam, cdec, b, h, t0, n, C, T, H, dk, dv);
        for (int x = threadIdx.x; x < n * dv; x += blockDim.x) {   // O = diag(gam) Q S0 + M U
            int i = x / dv, j = x % dv;
            float o = __fmul_rn(gam[i], w.QS[x]);
            for (int l = 0; l <= i; ++l) o = __fadd_rn(o, __fmul_rn(w.M[i * C + l], w.U[l * dv + j]));
            out[(size_t)(row0 + i * H) * dv + j] = o;
        }
        tg_delta_advance(k, w, S, S, gam, cdec, row0, n, H, dk, dv);
    }
    if (with_state)
        for (int x = threadIdx.x; x < plane; x += blockDim.x)
            out[(size_t)B * T * H * dv + (size_t)bh * plane + x] = S[x];
}

// Backward, chunk by chunk from the last, carrying dS = d loss / d (the state after the
// chunk). Per chunk, with dO the chunk's output gradient (rows of `dout`):
//   dU = M^T dO + diag(cdec) K dS,   (I + A)^T dR = dU,   dA = -strictly_lower(dR U^T),
//   dM = lower(dO U^T),   dV = diag(beta) dR,   dbeta_i = dR_i.(v_i - gam_i KS_i) + dA_i.P_i
//   dQ = diag(gam) dO S0^T + (dM * D) K
//   dK = (dM * D)^T Q + diag(cdec) U dS^T - diag(gam beta) dR S0^T + (E + E^T) K,
//        E = diag(beta) dA * D
//   d cg_i = rowsum_i(F) - colsum_i(F) + gam_i (dO_i.QS_i - beta_i dR_i.KS_i) - cdec_i U_i.KdS_i
//            (+ at i = n-1: sum_l cdec_l U_l.KdS_l + gam_{n-1} sum(dS * S0)),
//        F = dM * M + dA * A,  KdS = K dS;  dg = the reversed running sum of d cg
//   dS0 = gam_{n-1} dS + Q^T diag(gam) dO - K^T diag(gam beta) dR
// The chunk-start states come from a forward pass first. Output packed [dq, dk, dv, dg,
// dbeta] in the sources' layouts. Scratch per (b, h): the n_chunks start states, dS, the
// ChunkBufs, dM and dA [C][C], dR and KdS [C][dv].
extern "C" __global__ void tg_delta_chunked_back(float* out, const float* q, const float* k,
                                                 const float* v, const float* g,
                                                 const float* beta, const float* dout,
                                                 float* scratch, int B, int T, int H, int dk,
                                                 int dv, int C) {
    __shared__ float cg[TG_DELTA_CHUNK], gam[TG_DELTA_CHUNK], cdec[TG_DELTA_CHUNK];
    __shared__ float dcg[TG_DELTA_CHUNK], sh[TG_THREADS];
    int bh = blockIdx.x, b = bh / H, h = bh % H, tid = threadIdx.x, nt = blockDim.x;
    int plane = dk * dv, n_ck = (T + C - 1) / C;
    float* starts = scratch + (size_t)bh * ((n_ck + 1) * plane + 5 * C * C + 5 * C * dv);
    float* dS = starts + (size_t)n_ck * plane;
    ChunkBufs w = tg_delta_bufs(dS + plane, C, dv);
    float *dM = w.U + C * dv, *dA = dM + C * C, *dR = dA + C * C, *KdS = dR + C * dv;
    size_t nq = (size_t)B * T * H * dk, nv = (size_t)B * T * H * dv, ng = (size_t)B * T * H;
    float *dq = out, *dkk = out + nq, *dvv = out + 2 * nq, *dg = dvv + nv, *db = dg + ng;
    for (int x = tid; x < plane; x += nt) starts[x] = 0.0f, dS[x] = 0.0f;
    __syncthreads();
    for (int c = 0; c + 1 < n_ck; ++c) {   // the state at each chunk start
        int t0 = c * C, row0 = (b * T + t0) * H + h;
        float* S0 = starts + (size_t)c * plane;
        tg_delta_prepare(q, k, v, g, beta, S0, w, cg, gam, cdec, b, h, t0, C, C, T, H, dk, dv);
        tg_delta_advance(k, w, S0, S0 + plane, gam, cdec, row0, C, H, dk, dv);
    }
    for (int c = n_ck - 1; c >= 0; --c) {
        int t0 = c * C, n = min(C, T - t0), row0 = (b * T + t0) * H + h;
        const float* S0 = starts + (size_t)c * plane;
        tg_delta_prepare(q, k, v, g, beta, S0, w, cg, gam, cdec, b, h, t0, n, C, T, H, dk, dv);
#define TG_ROW(i) ((size_t)(row0 + (i) * H))
        for (int x = tid; x < n * dv; x += nt) {   // dU (into dR), K dS
            int i = x / dv, j = x % dv;
            float kds = tg_delta_dot(k + TG_ROW(i) * dk, 1, dS + j, dv, dk), du = 0.0f;
            for (int l = i; l < n; ++l)
                du = __fadd_rn(du, __fmul_rn(w.M[l * C + i], dout[TG_ROW(l) * dv + j]));
            KdS[x] = kds;
            dR[x] = __fadd_rn(du, __fmul_rn(cdec[i], kds));
        }
        __syncthreads();
        for (int j = tid; j < dv; j += nt)          // (I + A)^T dR = dU, last row first
            for (int i = n - 2; i >= 0; --i) {
                float acc = 0.0f;
                for (int l = i + 1; l < n; ++l)
                    acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(beta[TG_ROW(l)], w.P[l * C + i]),
                                                   dR[l * dv + j]));
                dR[i * dv + j] = __fsub_rn(dR[i * dv + j], acc);
            }
        __syncthreads();
        for (int x = tid; x < n * n; x += nt) {     // dM, dA
            int i = x / n, l = x % n;
            dM[i * C + l] = l <= i ? tg_delta_dot(dout + TG_ROW(i) * dv, 1, w.U + l * dv, 1, dv) : 0.0f;
            dA[i * C + l] = l < i ? -tg_delta_dot(dR + i * dv, 1, w.U + l * dv, 1, dv) : 0.0f;
        }
        __syncthreads();
        for (int x = tid; x < n * dk; x += nt) {    // dq, dk
            int i = x / dk, d = x % dk;
            float bi = beta[TG_ROW(i)];
            float aq = __fmul_rn(gam[i], tg_delta_dot(dout + TG_ROW(i) * dv, 1, S0 + d * dv, 1, dv));
            float ak = __fsub_rn(__fmul_rn(cdec[i], tg_delta_dot(w.U + i * dv, 1, dS + d * dv, 1, dv)),
                                 __fmul_rn(__fmul_rn(gam[i], bi),
                                           tg_delta_dot(dR + i * dv, 1, S0 + d * dv, 1, dv)));
            for (int l = 0; l < n; ++l) {
                float kl = k[TG_ROW(l) * dk + d], ql = q[TG_ROW(l) * dk + d];
                if (l <= i) aq = __fadd_rn(aq, __fmul_rn(__fmul_rn(dM[i * C + l], w.D[i * C + l]), kl));
                if (l >= i) ak = __fadd_rn(ak, __fmul_rn(__fmul_rn(dM[l * C + i], w.D[l * C + i]), ql));
                float e = __fadd_rn(__fmul_rn(__fmul_rn(bi, dA[i * C + l]), w.D[i * C + l]),
                                    __fmul_rn(__fmul_rn(beta[TG_ROW(l)], dA[l * C + i]), w.D[l * C + i]));
                ak = __fadd_rn(ak, __fmul_rn(e, kl));
            }
            dq[TG_ROW(i) * dk + d] = aq;
            dkk[TG_ROW(i) * dk + d] = ak;
        }
        for (int x = tid; x < n * dv; x += nt)      // dv
            dvv[TG_ROW(x / dv) * dv + x % dv] = __fmul_rn(beta[TG_ROW(x / dv)], dR[x]);
        float last = 0.0f, dss = 0.0f;              // the sums that land on d cg_{n-1}
        for (int i = tid; i < n; i += nt) {         // dbeta, d cg
            float bi = beta[TG_ROW(i)], fb = 0.0f, fa = 0.0f, rv = 0.0f, rk = 0.0f;
            const float *dri = dR + i * dv, *vi = v + TG_ROW(i) * dv, *ui = w.U + i * dv;
            for (int j = 0; j < dv; ++j) {
                rv = __fadd_rn(rv, __fmul_rn(dri[j], vi[j]));
                rk = __fadd_rn(rk, __fmul_rn(dri[j], w.KS[i * dv + j]));
            }
            float pa = 0.0f;
            for (int l = 0; l < n; ++l) {
                float fil = __fadd_rn(__fmul_rn(dM[i * C + l], w.M[i * C + l]),
                                      __fmul_rn(__fmul_rn(dA[i * C + l], bi), w.P[i * C + l]));
                float fli = __fadd_rn(__fmul_rn(dM[l * C + i], w.M[l * C + i]),
                                      __fmul_rn(__fmul_rn(dA[l * C + i], beta[TG_ROW(l)]),
                                                w.P[l * C + i]));
                fa = __fadd_rn(fa, fil);
                fb = __fadd_rn(fb, fli);
                pa = __fadd_rn(pa, __fmul_rn(dA[i * C + l], w.P[i * C + l]));
            }
            db[TG_ROW(i)] = __fadd_rn(__fsub_rn(rv, __fmul_rn(gam[i], rk)), pa);
            float uk = __fmul_rn(cdec[i], tg_delta_dot(ui, 1, KdS + i * dv, 1, dv));
            float og = tg_delta_dot(dout + TG_ROW(i) * dv, 1, w.QS + i * dv, 1, dv);
            dcg[i] = __fsub_rn(__fadd_rn(__fsub_rn(fa, fb),
                                         __fmul_rn(gam[i], __fsub_rn(og, __fmul_rn(bi, rk)))), uk);
            last = __fadd_rn(last, uk);
        }
        for (int x = tid; x < plane; x += nt) dss = __fadd_rn(dss, __fmul_rn(dS[x], S0[x]));
        last = tg_block_sum(last, sh);
        dss = tg_block_sum(dss, sh);
        if (tid == 0) {
            dcg[n - 1] = __fadd_rn(dcg[n - 1], __fadd_rn(last, __fmul_rn(gam[n - 1], dss)));
            float acc = 0.0f;
            for (int i = n - 1; i >= 0; --i) dg[TG_ROW(i)] = acc = __fadd_rn(acc, dcg[i]);
        }
        for (int x = tid; x < plane; x += nt) {     // dS0
            int d = x / dv, j = x % dv;
            float acc = __fmul_rn(gam[n - 1], dS[x]);
            for (int i = 0; i < n; ++i) {
                float qg = __fmul_rn(gam[i], q[TG_ROW(i) * dk + d]);
                float kgb = __fmul_rn(__fmul_rn(gam[i], beta[TG_ROW(i)]), k[TG_ROW(i) * dk + d]);
                acc = __fadd_rn(acc, __fsub_rn(__fmul_rn(qg, dout[TG_ROW(i) * dv + j]),
                                               __fmul_rn(kgb, dR[i * dv + j])));
            }
            dS[x] = acc;
        }
        __syncthreads();
#undef TG_ROW
    }
}
