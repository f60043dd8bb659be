// Embedding gather/scatter and the cross-entropy loss over integer labels (-1 = ignored).

extern "C" __global__ void tg_get_rows(float* out, const float* table, const int* ids, int n,
                                       int D) {
    TG_GRID_LOOP(e, n) {
        int i = e / D, j = e - i * D;
        out[e] = table[(long long)ids[i] * D + j];
    }
}

// out [rows, D] (zeroed beforehand) gets, for every distinct id, the sum of the gradient
// rows of the tokens that use it. The block of an id's first token does the whole sum, in
// token order: the same additions, in the same order, as numpy's add.at, and no atomics.
extern "C" __global__ void tg_get_rows_back(float* out, const float* g, const int* ids, int N,
                                            int D) {
    __shared__ int seen_before;
    for (int i = blockIdx.x; i < N; i += gridDim.x) {
        int id = ids[i];
        if (threadIdx.x == 0) seen_before = 0;
        __syncthreads();
        for (int k = threadIdx.x; k < i; k += blockDim.x)
            if (ids[k] == id) seen_before = 1;  // every writer stores the same value
        __syncthreads();
        if (!seen_before) {
            for (int j = threadIdx.x; j < D; j += blockDim.x) {
                float acc = 0.0f;
                for (int k = i; k < N; ++k)
                    if (ids[k] == id) acc = __fadd_rn(acc, g[(long long)k * D + j]);
                out[(long long)id * D + j] = acc;
            }
        }
        __syncthreads();
    }
}

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

// d loss / d logits = (softmax - onehot(label)) * w, w = g (sum) or g / n (mean), 0 on
// ignored rows. One block per row.
extern "C" __global__ void tg_ce_back(float* out, const float* logits, const int* labels,
                                      const float* g, int N, int V, int mean) {
    __shared__ float sh[TG_THREADS];
    __shared__ int ish[TG_THREADS];
    int n = tg_count_labels(labels, N, ish);
    float w = !mean ? g[0] : (n ? __fdiv_rn(g[0], (float)n) : __fmul_rn(0.0f, g[0]));
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const float* l = logits + (long long)row * V;
        float* o = out + (long long)row * V;
        int lab = labels[row];
        float wv = lab >= 0 ? w : 0.0f;
        float total = tg_row_exp_sum(l, tg_row_max(l, V, sh), V, sh, o);
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float p = __fdiv_rn(o[j], total);
            if (j == lab) p = __fsub_rn(p, 1.0f);
            o[j] = __fmul_rn(p, wv);
        }
    }
}

extern "C" __global__ void tg_count_valid(float* out, const int* labels, int N) {
    __shared__ int ish[TG_THREADS];
    int n = tg_count_labels(labels, N, ish);
    if (threadIdx.x == 0) out[0] = (float)n;
}
