// Embedding gather/scatter (ops/rows/): get_rows from an f32 table or from a frozen
// table W [rows, D] kept in its GGUF block format (row r is `row_bytes` bytes of blocks,
// decoded with blocks.cuh), and get_rows_back.

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

// out[i, :] = W[ids[i], :] for a table W [rows, D] in block format; n = len(ids) * D.
template <class F>
__device__ __forceinline__ void tg_get_rows_q(float* out, const unsigned char* table,
                                              const int* ids, int n, int D, int row_bytes) {
    TG_GRID_LOOP(e, n) {
        int i = e / D, j = e - i * D;
        out[e] = tg_dequant_at<F>(table + (long long)ids[i] * row_bytes, j);
    }
}

#define TG_QROWS_ARGS float* out, const unsigned char* table, const int* ids, int n, int D, int row_bytes

// tg_get_rows_<fmt>, one per block format of TG_BLOCK_FORMATS (blocks.c_defines).
#define TG_QROWS_KERNEL(fmt, NAME)                                                        \
    extern "C" __global__ void tg_get_rows_##fmt(TG_QROWS_ARGS) {                         \
        tg_get_rows_q<Tg##NAME>(out, table, ids, n, D, row_bytes);                        \
    }
TG_BLOCK_FORMATS(TG_QROWS_KERNEL)
