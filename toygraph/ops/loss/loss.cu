// The cross-entropy loss over integer labels (-1 = ignored) (ops/loss/), and the
// one kernel of its fused form with the output head, linear_cross_entropy.

// Per-row loss lse - logit[label] (0 for ignored rows) into `rowloss`; one block per row.
extern "C" __global__ void tg_ce_rows(float* rowloss, const float* logits, const int* labels,
                                      int N, int V) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const float* l = logits + (long long)row * V;
        float mx = tg_row_max(l, V, sh);
        float total = tg_row_exp_sum(l, mx, V, sh, nullptr);
        if (threadIdx.x == 0) {
            int lab = labels[row];
            rowloss[row] = lab >= 0 ? __fsub_rn(__fadd_rn(logf(total), mx), l[lab]) : 0.0f;
        }
    }
}

__device__ __forceinline__ int tg_count_labels(const int* labels, int N, int* ish) {
    int c = 0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) c += labels[i] >= 0;
    return tg_block_sum(c, ish);
}

// One block: the sum of the row losses, divided by the valid count for "mean" (0 if none).
extern "C" __global__ void tg_ce_reduce(float* out, const float* rowloss, const int* labels,
                                        int N, int mean) {
    __shared__ float sh[TG_THREADS];
    __shared__ int ish[TG_THREADS];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) acc = __fadd_rn(acc, rowloss[i]);
    float total = tg_block_sum(acc, sh);
    int n = tg_count_labels(labels, N, ish);
    if (threadIdx.x == 0) out[0] = !mean ? total : (n ? __fdiv_rn(total, (float)n) : 0.0f);
}

// One row of d loss / d logits: (softmax(l) - onehot(lab)) * wv into o (o may be l).
__device__ __forceinline__ void tg_ce_back_row(float* o, const float* l, int lab, float wv,
                                               int V, float* sh) {
    float total = tg_row_exp_sum(l, tg_row_max(l, V, sh), V, sh, o);
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float p = __fdiv_rn(o[j], total);
        if (j == lab) p = __fsub_rn(p, 1.0f);
        o[j] = __fmul_rn(p, wv);
    }
}

// d loss / d logits = (softmax - onehot(label)) * w, w = g (sum) or g / n (mean), 0 on
// ignored rows. One block per row.
extern "C" __global__ void tg_ce_back(float* out, const float* logits, const int* labels,
                                      const float* g, int N, int V, int mean) {
    __shared__ float sh[TG_THREADS];
    __shared__ int ish[TG_THREADS];
    int n = tg_count_labels(labels, N, ish);
    float w = !mean ? g[0] : (n ? __fdiv_rn(g[0], (float)n) : __fmul_rn(0.0f, g[0]));
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        int lab = labels[row];
        tg_ce_back_row(out + (long long)row * V, logits + (long long)row * V, lab,
                       lab >= 0 ? w : 0.0f, V, sh);
    }
}

// The same for per-row losses (linear_cross_entropy's reduction "none"): row i's weight is
// its own g[i], 0 on ignored rows. One block per row.
extern "C" __global__ void tg_ce_back_rows(float* out, const float* logits, const int* labels,
                                           const float* g, int N, int V) {
    __shared__ float sh[TG_THREADS];
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        int lab = labels[row];
        tg_ce_back_row(out + (long long)row * V, logits + (long long)row * V, lab,
                       lab >= 0 ? g[row] : 0.0f, V, sh);
    }
}

extern "C" __global__ void tg_count_valid(float* out, const int* labels, int N) {
    __shared__ int ish[TG_THREADS];
    int n = tg_count_labels(labels, N, ish);
    if (threadIdx.x == 0) out[0] = (float)n;
}

// The fused output head + cross-entropy (ops.linear_cross_entropy) has no kernel of its
// own but the one below: its lowering (ops/loss/) turns it into launches over chunks of
// rows with one [rows, vocab] scratch block. Per chunk, tg_matmul (or a block-format tg_qmm_nt_*) fills the block
// with logits; forward, tg_ce_rows writes the chunk's row losses and tg_ce_reduce sums all
// rows at the end (reduction "none": tg_ce_rows writes the output, no reduce); backward,
// tg_ce_back (tg_ce_back_rows for "none") turns the block into dlogits in place, tg_matmul
// (tg_qmm_nn_*) writes the chunk's dh rows and tg_matmul_acc adds its dw = dlogits^T h
// into dw, chunk after chunk. No float atomics: every result is deterministic.

// The weight every non-ignored row's dlogits is scaled by: g (sum) or g / n (mean; 0 when
// no label counts), computed as tg_ce_back does, so each chunk can run tg_ce_back with
// mean = 0 on this weight although the chunk sees only some of the labels.
extern "C" __global__ void tg_lce_grad_scale(float* gs, const int* labels, int N,
                                             const float* g, int mean) {
    __shared__ int ish[TG_THREADS];
    int n = tg_count_labels(labels, N, ish);
    if (threadIdx.x == 0)
        gs[0] = !mean ? g[0] : (n ? __fdiv_rn(g[0], (float)n) : __fmul_rn(0.0f, g[0]));
}
