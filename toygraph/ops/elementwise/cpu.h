// The elementwise family's replay kernels (replay.h): add, sub, mul (numpy broadcasting,
// through a Walk), scale, and the activations with their backward ops, each element
// computed with the numpy kernel's operations in its order (exp and tanh from vmath.h).
//
// Walk and walk_for serve the shape and slicing families' copies too (their cpu.h come
// after this one in engine.py's folder order).

// An output of up to six axes, row-major and contiguous, walked by rows (its last axis),
// and where each operand's element of it lies: element strides per axis, 0 on an axis the
// operand is broadcast over. shape/cpu.py's walk() packs it as int64 [axes, sizes[6],
// strides of operand 0 [6], of operand 1 [6], ...], size-1 axes dropped and axes merged
// where every operand steps through them as one.
static const int kWalkDims = 6;

struct Walk {
    const int64_t* w;

    int nd() const { return (int)w[0]; }
    int64_t extent(int d) const { return w[1 + d]; }
    int64_t stride(int k, int d) const { return w[1 + kWalkDims * (k + 1) + d]; }
    // The last axis: its length and operand k's step along it.
    int64_t row() const { return extent(nd() - 1); }
    int64_t step(int k) const { return stride(k, nd() - 1); }
    int64_t rows() const {
        int64_t r = 1;
        for (int d = 0; d + 1 < nd(); d++) r *= extent(d);
        return r;
    }
    // Operand k's element offset of the first element of row r.
    int64_t at(int k, int64_t r) const {
        int64_t off = 0;
        for (int d = nd() - 2; d >= 0; d--) {
            off += (r % extent(d)) * stride(k, d);
            r /= extent(d);
        }
        return off;
    }
};

// f(row, j0, j1) over every row in pieces of at most kReplayGrain elements, so a long row
// (a same-shape operation is one row) is split over the pool as well as many short ones.
template <class F>
static void walk_for(const Walk& wk, F&& f) {
    const int64_t L = wk.row(), pieces = (L + kReplayGrain - 1) / kReplayGrain;
    replay_for(wk.rows() * pieces, L < kReplayGrain ? L : kReplayGrain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const int64_t r = t / pieces, j0 = (t % pieces) * kReplayGrain;
            f(r, j0, j0 + kReplayGrain < L ? j0 + kReplayGrain : L);
        }
    });
}

// o[j] = f(a[j sa], b[j sb]) for j in [j0, j1): the steps of a broadcast walk's last axis
// are 1 or 0, the common pairs as loops the compiler vectorises.
template <class F>
static inline void ew_row(float* o, const float* a, int64_t sa, const float* b, int64_t sb,
                          int64_t j0, int64_t j1, F&& f) {
    if (sa == 1 && sb == 1)
        for (int64_t j = j0; j < j1; j++) o[j] = f(a[j], b[j]);
    else if (sa == 1 && sb == 0)
        for (int64_t j = j0; j < j1; j++) o[j] = f(a[j], b[0]);
    else if (sa == 0 && sb == 1)
        for (int64_t j = j0; j < j1; j++) o[j] = f(a[0], b[j]);
    else
        for (int64_t j = j0; j < j1; j++) o[j] = f(a[j * sa], b[j * sb]);
}

// out = f(a, b), b (or a) broadcast as the walk says; b may be null (scale).
// p: out, a, b or null, walk (2 operands); f: s (scale).
template <class F>
static void elementwise(const ReplayNode& n, F&& f) {
    float* out = (float*)n.p[0];
    const float *a = (const float*)n.p[1], *b = (const float*)n.p[2];
    const Walk wk{(const int64_t*)n.p[3]};
    const float zero = 0.0f;
    const int64_t L = wk.row();
    walk_for(wk, [&](int64_t r, int64_t j0, int64_t j1) {
        ew_row(out + r * L, a + wk.at(0, r), wk.step(0), b ? b + wk.at(1, r) : &zero,
               b ? wk.step(1) : 0, j0, j1, f);
    });
}

TG_REPLAY_KERNEL(add) {
    elementwise(n, [](float a, float b) { return a + b; });
    return 0;
}

TG_REPLAY_KERNEL(sub) {
    elementwise(n, [](float a, float b) { return a - b; });
    return 0;
}

TG_REPLAY_KERNEL(mul) {
    elementwise(n, [](float a, float b) { return a * b; });
    return 0;
}

TG_REPLAY_KERNEL(scale) {
    const float s = (float)n.f[0];
    elementwise(n, [s](float a, float) { return a * s; });
    return 0;
}

// --- the activations: whole vectors over same-shape operands ---------------------------------

// y = f(x[0], x[1], x[2]) over n elements of up to three inputs of one shape, whole vectors
// then one padded with zeros (every function below is finite at 0).
template <class F>
static void ew_map(float* out, const float* const* in, int n_in, int64_t n, F&& f) {
    replay_for((n + VW - 1) / VW, VW, [&](int64_t v0, int64_t v1) {
        for (int64_t v = v0; v < v1; v++) {
            const int64_t i = v * VW, m = n - i < VW ? n - i : VW;
            vf x[3] = {};
            if (m == VW) {
                for (int k = 0; k < n_in; k++) x[k] = vf_load(in[k] + i);
                vf_store(out + i, f(x[0], x[1], x[2]));
                continue;
            }
            float buf[3][VW] = {};
            for (int k = 0; k < n_in; k++) {
                memcpy(buf[k], in[k] + i, (size_t)m * 4);
                x[k] = vf_load(buf[k]);
            }
            vf_store(buf[0], f(x[0], x[1], x[2]));
            memcpy(out + i, buf[0], (size_t)m * 4);
        }
    });
}

// The unary activations and their backward ops, in the order of cpu.py's ACTIVATIONS
// (the index it passes as i[1]).
enum EwAct { kSilu, kSiluBack, kGelu, kGeluBack, kSigmoid, kSigmoidBack, kSoftcap, kSoftcapBack };

// x / (1 + exp(-x)): exp overflows to inf below -88.7 and the quotient is then -0, as numpy's.
static inline vf ew_silu(vf x) { return x / (1.0f + vf_exp(-x)); }

// ((1 + x (1 - s)) s) g, s = 1 / (1 + exp(-x)): numpy's in-place steps in order.
static inline vf ew_silu_back(vf x, vf g) {
    const vf s = 1.0f / (1.0f + vf_exp(-x));
    return (1.0f + x * (1.0f - s)) * s * g;
}

static const float kEwGeluC = 0.7978845608028654f, kEwGeluA = 0.044715f;

// tanh(c (x + a x x x)), the products left to right as numpy's (a x) x x.
static inline vf ew_gelu_tanh(vf x) { return vf_tanh(kEwGeluC * (x + kEwGeluA * x * x * x)); }

static inline vf ew_gelu(vf x) { return x * (0.5f * (1.0f + ew_gelu_tanh(x))); }

// g (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3a x x)), numpy's expression left to right.
static inline vf ew_gelu_back(vf x, vf g) {
    const vf t = ew_gelu_tanh(x);
    const float a3 = (float)(3 * 0.044715);
    return g * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kEwGeluC * (1.0f + a3 * x * x));
}

// numpy's _sigmoid: exp of -|x| only, 1 / (1 + e) at x >= 0, e / (1 + e) below.
static inline vf ew_sigmoid(vf x) {
    const vf e = vf_exp(-(x < 0.0f ? -x : x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// One activation, chosen at compile time (a switch per vector would cost as much as a
// silu): act(x) or act'(x) g, c its parameter (softcap's cap).
template <int A>
static inline vf ew_act(float c, vf x, vf g) {
    switch (A) {
    case kSilu: return ew_silu(x);
    case kSiluBack: return ew_silu_back(x, g);
    case kGelu: return ew_gelu(x);
    case kGeluBack: return ew_gelu_back(x, g);
    case kSigmoid: return ew_sigmoid(x);
    case kSigmoidBack: {
        const vf s = ew_sigmoid(x);
        return g * s * (1.0f - s);
    }
    case kSoftcap: return vf_tanh(x / c) * c;
    default: {   // kSoftcapBack: g (1 - t t), t = tanh(x / c)
        const vf t = vf_tanh(x / c);
        return g * (1.0f - t * t);
    }
    }
}

template <int A>
static void ew_activation(const ReplayNode& n) {
    const float* in[2] = {(const float*)n.p[1], (const float*)n.p[2]};
    const float c = (float)n.f[0];
    ew_map((float*)n.p[0], in, in[1] ? 2 : 1, n.i[0], [c](vf x, vf g, vf) { return ew_act<A>(c, x, g); });
}

// out = act(x) or act'(x) g. p: out, x, g or null; i: n, act; f: cap.
TG_REPLAY_KERNEL(activation) {
    switch (n.i[1]) {
    case kSilu: ew_activation<kSilu>(n); return 0;
    case kSiluBack: ew_activation<kSiluBack>(n); return 0;
    case kGelu: ew_activation<kGelu>(n); return 0;
    case kGeluBack: ew_activation<kGeluBack>(n); return 0;
    case kSigmoid: ew_activation<kSigmoid>(n); return 0;
    case kSigmoidBack: ew_activation<kSigmoidBack>(n); return 0;
    case kSoftcap: ew_activation<kSoftcap>(n); return 0;
    case kSoftcapBack: ew_activation<kSoftcapBack>(n); return 0;
    default: return -1;
    }
}

// gpt-oss's clamped SwiGLU, numpy's _swiglu_oai_parts: gc = min(gate, limit),
// uc = clip(up, -limit, limit), s = 1 / (1 + exp(-alpha gc)).
struct EwOai {
    vf gc, uc, s;
};

static inline EwOai ew_oai(vf gate, vf up, float alpha, float limit) {
    EwOai p;
    const vf hi = vf_set(limit), lo = vf_set(-limit);
    p.gc = gate > hi ? hi : gate;   // a nan stays nan, as numpy's minimum and clip keep it
    p.uc = up > hi ? hi : (up < lo ? lo : up);
    p.s = 1.0f / (1.0f + vf_exp(-alpha * p.gc));
    return p;
}

// out = gc s (uc + 1). p: out, gate, up; i: n; f: alpha, limit.
TG_REPLAY_KERNEL(swiglu_oai) {
    const float* in[2] = {(const float*)n.p[1], (const float*)n.p[2]};
    const float alpha = (float)n.f[0], limit = (float)n.f[1];
    ew_map((float*)n.p[0], in, 2, n.i[0], [=](vf gate, vf up, vf) {
        const EwOai p = ew_oai(gate, up, alpha, limit);
        return p.gc * p.s * (p.uc + 1.0f);
    });
    return 0;
}

// d gate (wrt 0) = g (uc + 1) (s + alpha gc s (1 - s)) where gate <= limit, else 0;
// d up (wrt 1) = g (gc s) where |up| <= limit, else 0.
// p: out, gate, up, g; i: n, wrt; f: alpha, limit.
TG_REPLAY_KERNEL(swiglu_oai_back) {
    const float* in[3] = {(const float*)n.p[1], (const float*)n.p[2], (const float*)n.p[3]};
    const float alpha = (float)n.f[0], limit = (float)n.f[1];
    const bool wrt_up = n.i[1] == 1;
    ew_map((float*)n.p[0], in, 3, n.i[0], [=](vf gate, vf up, vf g) {
        const EwOai p = ew_oai(gate, up, alpha, limit);
        if (wrt_up) {
            const vf au = up < 0.0f ? -up : up;
            return au <= limit ? g * (p.gc * p.s) : vf{};   // nan: not <=, so 0
        }
        const vf d = g * (p.uc + 1.0f) * (p.s + alpha * p.gc * p.s * (1.0f - p.s));
        return gate <= limit ? d : vf{};
    });
    return 0;
}
