// The Gated DeltaNet ops (ops/deltanet.py): the causal depthwise conv1d and the gated delta
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

// Forward: one thread per (b, h, column j), sequential in time. `state` (nullable) is the
// initial state; with_state also writes the final state after o.
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

// Backward: one block per (b, h); thread j < dv owns column j of the state, thread i < dk
// sums row i of the per-column contributions to dq and dk (no float atomics). Scratch per
// (b, h): the state every `span` steps, the states S_{t-1} of the span being walked back,
// and two [dv][dk] blocks of per-column contributions. Output packed [dq, dk, dv, dg, dbeta]
// in the sources' layouts.
extern "C" __global__ void tg_delta_rule_back(float* out, const float* q, const float* k,
                                              const float* v, const float* g,
                                              const float* beta, const float* dout,
                                              float* scratch, int B, int T, int H, int dk,
                                              int dv, int span) {
    __shared__ float sh[TG_THREADS];
    float s[TG_DELTA_MAX_DK], ds[TG_DELTA_MAX_DK];
    int bh = blockIdx.x, b = bh / H, h = bh % H, j = threadIdx.x;
    int n_ck = (T + span - 1) / span, plane = dk * dv;
    float* ck = scratch + (size_t)bh * (n_ck + span + 2) * plane;   // [n_ck][dk][dv]
    float* st = ck + (size_t)n_ck * plane;                           // [span][dk][dv]
    float* rq = st + (size_t)span * plane;                           // [dv][dk]
    float* rk = rq + plane;                                          // [dv][dk]
    size_t nq = (size_t)B * T * H * dk, nv = (size_t)B * T * H * dv, ng = (size_t)B * T * H;
    float *dq = out, *dkk = out + nq, *dvv = out + 2 * nq, *dg = dvv + nv, *db = dg + ng;
    bool col = j < dv;
    // The state at each span's start, by the forward recurrence.
    for (int i = 0; i < dk; ++i) s[i] = 0.0f, ds[i] = 0.0f;
    for (int t = 0; t < T; ++t) {
        if (t % span == 0 && col)
            for (int i = 0; i < dk; ++i) ck[(size_t)(t / span) * plane + i * dv + j] = s[i];
        int bth = (b * T + t) * H + h;
        float err;
        if (col) tg_delta_step(s, q + bth * dk, k + bth * dk, v[bth * dv + j], expf(g[bth]),
                               beta[bth], dk, err);
    }
    for (int c = n_ck - 1; c >= 0; --c) {
        int t0 = c * span, t1 = min(T, t0 + span);
        if (col) {   // S_{t-1} of each step of the span
            for (int i = 0; i < dk; ++i) s[i] = ck[(size_t)c * plane + i * dv + j];
            for (int t = t0; t < t1; ++t) {
                for (int i = 0; i < dk; ++i) st[(size_t)(t - t0) * plane + i * dv + j] = s[i];
                int bth = (b * T + t) * H + h;
                float err;
                tg_delta_step(s, q + bth * dk, k + bth * dk, v[bth * dv + j], expf(g[bth]),
                              beta[bth], dk, err);
            }
        }
        for (int t = t1 - 1; t >= t0; --t) {
            int bth = (b * T + t) * H + h;
            const float *qt = q + bth * dk, *kt = k + bth * dk;
            float a = expf(g[bth]), bt = beta[bth], gsum = 0.0f, bsum = 0.0f;
            if (col) {
                const float* sp = st + (size_t)(t - t0) * plane + j;   // S_{t-1}[:, j]
                for (int i = 0; i < dk; ++i) s[i] = sp[i * dv];
                float err;
                tg_delta_step(s, qt, kt, v[bth * dv + j], a, bt, dk, err);  // s = S_t[:, j]
                float dot = dout[bth * dv + j], d = __fmul_rn(bt, err), dd = 0.0f;
                for (int i = 0; i < dk; ++i) {
                    ds[i] = __fadd_rn(ds[i], __fmul_rn(qt[i], dot));          // o = S^T q
                    rq[j * dk + i] = __fmul_rn(s[i], dot);                     // dq = S do
                    dd = __fadd_rn(dd, __fmul_rn(ds[i], kt[i]));               // S = P + k d^T
                }
                bsum = __fmul_rn(dd, err);                                     // d = beta err
                float derr = __fmul_rn(bt, dd);
                dvv[bth * dv + j] = derr;
                for (int i = 0; i < dk; ++i) {
                    float p = __fmul_rn(a, sp[i * dv]);                        // P = a S_{t-1}
                    rk[j * dk + i] = __fsub_rn(__fmul_rn(ds[i], d), __fmul_rn(p, derr));
                    float dp = __fsub_rn(ds[i], __fmul_rn(kt[i], derr));       // err = v - P^T k
                    gsum = __fadd_rn(gsum, __fmul_rn(dp, sp[i * dv]));
                    ds[i] = __fmul_rn(dp, a);
                }
                gsum = __fmul_rn(gsum, a);
            }
            float gt = tg_block_sum(gsum, sh), btot = tg_block_sum(bsum, sh);  // syncs rq, rk
            if (j < dk) {
                float aq = 0.0f, ak = 0.0f;
                for (int jj = 0; jj < dv; ++jj) {
                    aq = __fadd_rn(aq, rq[jj * dk + j]);
                    ak = __fadd_rn(ak, rk[jj * dk + j]);
                }
                dq[bth * dk + j] = aq;
                dkk[bth * dk + j] = ak;
            }
            if (j == 0) dg[bth] = gt, db[bth] = btot;
            __syncthreads();   // rq and rk are written again by the next step
        }
    }
}
