// Products of a few rows (generation's one-token step, M = 1; GRPO's group, M <= DOT_MAX_M)
// with a weight in its blocks: a pass over the weight's bytes, so the work per weight must
// be a handful of instructions. A block's integers are converted to f32 and multiplied
// with x in vector registers, and the block's scale is applied once to that partial sum
// instead of to every weight (sum_i x_i (a q_i + b) = a (x . q) + b sum_i x_i, with the
// sums of x per 32 worked out once per product). The activations stay f32: no rounding of
// x to 8 bits as llama.cpp does; the order of the sums is the engine's own (vector partial
// sums), so the result agrees with the decoded weight's product to f32 rounding.
//
// Formats without a fused kernel here (q2_k, q3_k, iq4_nl, iq4_xs, mxfp4, f16, bf16) take
// the row path: decode a row of W into L1 (decode.h) and dot it with each row of x.

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")   // a * b + c in this section is one FMA

static const int DOT_ROWS = 16;   // rows of W per task at least: a 64-byte line of output
static const int DOT_MAX_M = 4;   // rows of x up to which these kernels beat the panels

// Rows of W per task: a whole number of DOT_ROWS, so that about four tasks fall to each
// thread. A task of 16 rows of a 576-wide weight is a quarter of a microsecond, and at two
// threads the pool's shared task counters then cost more than the work (generation ran
// slower on two threads than on one); which thread takes which rows changes no value.
static int64_t dot_rows_per_task(int64_t N) {
    const int64_t want = 4 * (int64_t)pool_threads();
    int64_t rows = (N + want - 1) / want;
    rows = (rows + DOT_ROWS - 1) / DOT_ROWS * DOT_ROWS;
    return rows < DOT_ROWS ? DOT_ROWS : rows;
}

// A block's f16 scale as f32 by the CPU's own conversion where it has one (one instruction
// instead of decode.h's exact branches; the two differ only in a signalling NaN's quiet
// bit, which a product does not see).
static inline float scale16(const u8* p) {
#if defined(__F16C__)
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 h;
    std::memcpy(&h, p, 2);
    return (float)h;
#else
    return half(p);
#endif
}

static inline v16f loadx(const float* p) {
    v16f v;
    std::memcpy(&v, p, 64);
    return v;
}

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

// One block of each format: acc[m] += a * (x_m . q) over the block's groups, and
// off[m] += b * xs_m (xs: x's sum over the block's 32-element groups, for the formats with
// an offset). ``x`` points at the block's first column, rows ldx apart.
template <int M>
static inline void dot_q8_0(const u8* b, const float* x, int64_t ldx, const float*, int64_t, v16f* acc, float*) {
    const v16f d = splat(scale16(b + TG_Q8_0_D));
    const v16f q0 = to_float(widen_signed(load16(b + TG_Q8_0_QS)));
    const v16f q1 = to_float(widen_signed(load16(b + TG_Q8_0_QS + 16)));
    for (int m = 0; m < M; m++) acc[m] += d * (loadx(x + m * ldx) * q0 + loadx(x + m * ldx + 16) * q1);
}

template <int M>
static inline void dot_q4_0(const u8* b, const float* x, int64_t ldx, const float*, int64_t, v16f* acc, float*) {
    const v16u8 qs = load16(b + TG_Q4_0_QS);
    const v16f d = splat(scale16(b + TG_Q4_0_D));
    const v16f q0 = to_float(widen((v16u8)(qs & 0x0F)) - 8), q1 = to_float(widen(shr<4>(qs)) - 8);
    for (int m = 0; m < M; m++) acc[m] += d * (loadx(x + m * ldx) * q0 + loadx(x + m * ldx + 16) * q1);
}

template <int M>
static inline void dot_q5_0(const u8* b, const float* x, int64_t ldx, const float*, int64_t, v16f* acc, float*) {
    const v16u8 qs = load16(b + TG_Q5_0_QS);
    const uint32_t qh = qh_bits(b + TG_Q5_0_QH);
    const v16f d = splat(scale16(b + TG_Q5_0_D));
    const v16f q0 = to_float((widen((v16u8)(qs & 0x0F)) | bits16(qh, 0, 4)) - 16);
    const v16f q1 = to_float((widen(shr<4>(qs)) | bits16(qh, 16, 4)) - 16);
    for (int m = 0; m < M; m++) acc[m] += d * (loadx(x + m * ldx) * q0 + loadx(x + m * ldx + 16) * q1);
}

template <int M>
static inline void dot_q4_1(const u8* b, const float* x, int64_t ldx, const float* xs, int64_t ldxs, v16f* acc, float* off) {
    const v16u8 qs = load16(b + TG_Q4_1_QS);
    const v16f d = splat(scale16(b + TG_Q4_1_D));
    const float mn = scale16(b + TG_Q4_1_M);
    const v16f q0 = to_float((v16u8)(qs & 0x0F)), q1 = to_float(shr<4>(qs));
    for (int m = 0; m < M; m++) {
        acc[m] += d * (loadx(x + m * ldx) * q0 + loadx(x + m * ldx + 16) * q1);
        off[m] += mn * xs[m * ldxs];
    }
}

template <int M>
static inline void dot_q5_1(const u8* b, const float* x, int64_t ldx, const float* xs, int64_t ldxs, v16f* acc, float* off) {
    const v16u8 qs = load16(b + TG_Q5_1_QS);
    const uint32_t qh = qh_bits(b + TG_Q5_1_QH);
    const v16f d = splat(scale16(b + TG_Q5_1_D));
    const float mn = scale16(b + TG_Q5_1_M);
    const v16f q0 = to_float(widen((v16u8)(qs & 0x0F)) | bits16(qh, 0, 4));
    const v16f q1 = to_float(widen(shr<4>(qs)) | bits16(qh, 16, 4));
    for (int m = 0; m < M; m++) {
        acc[m] += d * (loadx(x + m * ldx) * q0 + loadx(x + m * ldx + 16) * q1);
        off[m] += mn * xs[m * ldxs];
    }
}

// Q4_K/Q5_K: 8 groups of 32 with scale d*sc[j] and offset -dmin*m[j].
template <int M, bool Q5>
static inline void dot_k(const u8* b, const float* x, int64_t ldx, const float* xs, int64_t ldxs, v16f* acc, float* off,
                         int d_off, int dmin_off, int sc_off, int qs_off, int qh_off) {
    const float d = scale16(b + d_off), dmin = scale16(b + dmin_off);
    for (int p = 0; p < 4; p++) {
        int sc0, mn0, sc1, mn1;
        k_scale(b + sc_off, 2 * p, &sc0, &mn0);
        k_scale(b + sc_off, 2 * p + 1, &sc1, &mn1);
        const v16f a0 = splat(d * (float)sc0), a1 = splat(d * (float)sc1);
        v16f lo[2], hi[2];
        for (int l = 0; l < 2; l++) {
            const v16u8 src = load16(b + qs_off + 32 * p + 16 * l);
            v16u8 ql = src & 0x0F, qhi = shr<4>(src);
            if (Q5) {
                const v16u8 qh = load16(b + qh_off + 16 * l);
                ql |= bit_set(qh, 2 * p) & 16;
                qhi |= bit_set(qh, 2 * p + 1) & 16;
            }
            lo[l] = to_float(ql);
            hi[l] = to_float(qhi);
        }
        for (int m = 0; m < M; m++) {
            const float* xm = x + m * ldx + 64 * p;
            acc[m] += a0 * (loadx(xm) * lo[0] + loadx(xm + 16) * lo[1]);
            acc[m] += a1 * (loadx(xm + 32) * hi[0] + loadx(xm + 48) * hi[1]);
            off[m] -= dmin * ((float)mn0 * xs[m * ldxs + 2 * p] + (float)mn1 * xs[m * ldxs + 2 * p + 1]);
        }
    }
}

template <int M>
static inline void dot_q4_k(const u8* b, const float* x, int64_t ldx, const float* xs, int64_t ldxs, v16f* acc, float* off) {
    dot_k<M, false>(b, x, ldx, xs, ldxs, acc, off, TG_Q4_K_D, TG_Q4_K_DMIN, TG_Q4_K_SCALES, TG_Q4_K_QS, 0);
}

template <int M>
static inline void dot_q5_k(const u8* b, const float* x, int64_t ldx, const float* xs, int64_t ldxs, v16f* acc, float* off) {
    dot_k<M, true>(b, x, ldx, xs, ldxs, acc, off, TG_Q5_K_D, TG_Q5_K_DMIN, TG_Q5_K_SCALES, TG_Q5_K_QS, TG_Q5_K_QH);
}

// Q6_K: 16 groups of 16, scale d*scales[g], values q - 32.
template <int M, int QUARTER>
static inline void dot_q6_k_quarter(const u8* b, float d, int h, const float* x, int64_t ldx, v16f* acc) {
    const signed char* scales = (const signed char*)(b + TG_Q6_K_SCALES);
    for (int half16 = 0; half16 < 2; half16++) {
        const int e0 = 128 * h + 32 * QUARTER + 16 * half16;
        const v16u8 ql = load16(b + TG_Q6_K_QL + 64 * h + ((QUARTER & 1) ? 32 : 0) + 16 * half16);
        const v16u8 qh = load16(b + TG_Q6_K_QH + 32 * h + 16 * half16);
        const v16u8 q = (v16u8)((shr<QUARTER >= 2 ? 4 : 0>(ql) & 0x0F) | ((shr<2 * QUARTER>(qh) & 3) << 4));
        const v16f a = splat(d * (float)scales[e0 / 16]);
        const v16f qf = to_float(widen(q) - 32);
        for (int m = 0; m < M; m++) acc[m] += a * (loadx(x + m * ldx + e0) * qf);
    }
}

template <int M>
static inline void dot_q6_k(const u8* b, const float* x, int64_t ldx, const float*, int64_t, v16f* acc, float*) {
    const float d = scale16(b + TG_Q6_K_D);
    for (int h = 0; h < 2; h++) {
        dot_q6_k_quarter<M, 0>(b, d, h, x, ldx, acc);
        dot_q6_k_quarter<M, 1>(b, d, h, x, ldx, acc);
        dot_q6_k_quarter<M, 2>(b, d, h, x, ldx, acc);
        dot_q6_k_quarter<M, 3>(b, d, h, x, ldx, acc);
    }
}

// Rows n0..n1 of W against M rows of x: each block's kernel over the row, then the sums.
template <int M, int QK, int BYTES,
          void (*F)(const u8*, const float*, int64_t, const float*, int64_t, v16f*, float*)>
static void dot_rows_fused(const Product& p, const float* xs, int64_t ldxs, int64_t n0, int64_t n1) {
    const int64_t blocks = p.K / QK;
    for (int64_t n = n0; n < n1; n++) {
        const u8* row = p.w + n * p.row_bytes;
        v16f acc[M];
        float off[M];
        for (int m = 0; m < M; m++) {
            acc[m] = (v16f){};
            off[m] = 0.0f;
        }
        for (int64_t i = 0; i < blocks; i++)
            F(row + i * BYTES, p.a + i * QK, p.lda, xs + i * (QK / 32), ldxs, acc, off);
        for (int m = 0; m < M; m++) p.c[m * p.ldc + n] = hsum(acc[m]) + off[m];
    }
}

typedef void (*DotRowsFn)(const Product&, const float*, int64_t, int64_t, int64_t);

#define TG_DOT(fn, NAME) {dot_rows_fused<1, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<1>>, \
    dot_rows_fused<2, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<2>>, \
    dot_rows_fused<3, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<3>>, \
    dot_rows_fused<4, TG_##NAME##_QK, TG_##NAME##_BYTES, fn<4>>}

// Per format (kFormats' order), the fused kernel for M = 1..4 rows; nullptr: the row path.
static const DotRowsFn kDotRows[][DOT_MAX_M] = {
    {}, {},                                           // f16, bf16
    TG_DOT(dot_q8_0, Q8_0), TG_DOT(dot_q4_0, Q4_0), TG_DOT(dot_q4_1, Q4_1),
    TG_DOT(dot_q5_0, Q5_0), TG_DOT(dot_q5_1, Q5_1), {},   // iq4_nl
    {}, {},                                           // q2_k, q3_k
    TG_DOT(dot_q4_k, Q4_K), TG_DOT(dot_q5_k, Q5_K), TG_DOT(dot_q6_k, Q6_K),
    {}, {},                                           // iq4_xs, mxfp4
};

// The row path: one decoded row of W in L1 dotted with each row of x.
static void dot_rows_decoded(const Product& p, int64_t n0, int64_t n1) {
    float* row = scratch((size_t)p.K);
    for (int64_t n = n0; n < n1; n++) {
        decode_row_part(*p.f, p.w + n * p.row_bytes, 0, p.K, row);
        for (int64_t m = 0; m < p.M; m++) {
            const float* x = p.a + m * p.lda;
            v16f s = (v16f){};
            int64_t k = 0;
            for (; k + 16 <= p.K; k += 16) s += loadx(x + k) * loadx(row + k);
            float t = hsum(s);
            for (; k < p.K; k++) t += x[k] * row[k];
            p.c[m * p.ldc + n] = t;
        }
    }
}

// x's sums over each 32 columns ([M][K / 32]), for the formats whose blocks have an offset.
static void x_sums(const Product& p, std::vector<float>& xs) {
    const int64_t ldxs = p.K / 32;
    xs.resize((size_t)(p.M * ldxs));
    for (int64_t m = 0; m < p.M; m++)
        for (int64_t g = 0; g < ldxs; g++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += p.a[m * p.lda + 32 * g + i];
            xs[m * ldxs + g] = s;
        }
}

static void matmul_dot(Product& p) {
    const int fmt = (int)(p.f - kFormats);
    const DotRowsFn fused = p.M <= DOT_MAX_M && p.K % 32 == 0 ? kDotRows[fmt][p.M - 1] : nullptr;
    std::vector<float> xs;
    const int64_t ldxs = p.K / 32;
    if (fused) x_sums(p, xs);
    const int64_t per = dot_rows_per_task(p.N);
    pool_for((p.N + per - 1) / per, [&](int64_t task, int) {
        const int64_t n0 = task * per, n1 = n0 + per < p.N ? n0 + per : p.N;
        if (fused) fused(p, xs.data(), ldxs, n0, n1);
        else dot_rows_decoded(p, n0, n1);
    });
}

#pragma GCC pop_options
