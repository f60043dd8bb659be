// Shared definitions for every toygraph kernel. Plain CUDA C++: no toolkit headers, so
// NVRTC needs nothing but its own wheel. f32 compute throughout; sizes are int (the
// backend refuses tensors of 2^31 elements or more at realize).
//
// Reductions are tree reductions in shared memory over a power-of-two block, in a fixed
// order, so every result is bit-identical run to run (no float atomics anywhere).

// TG_MAXD (dims of a Strided walk) and TG_THREADS (threads per block) come from
// toygraph/ops/lowering/constants.py, emitted ahead of this header.

// A strided walk over an index space of `nd` dims: element i (row-major over dims)
// reads operand 0 at offset sum(idx[d] * sa[d]) and operand 1 at sum(idx[d] * sb[d]).
// Broadcast dims have stride 0; the host splits grouped dims into (groups, group).
struct Strided {
    int nd;
    int dims[TG_MAXD];
    int sa[TG_MAXD];
    int sb[TG_MAXD];
};

__device__ __forceinline__ void tg_offsets(const Strided& s, int i, int& oa, int& ob) {
    oa = 0;
    ob = 0;
    for (int d = s.nd - 1; d >= 0; --d) {
        int q = i % s.dims[d];
        i /= s.dims[d];
        oa += q * s.sa[d];
        ob += q * s.sb[d];
    }
}

__device__ __forceinline__ int tg_offset_a(const Strided& s, int i) {
    int oa = 0;
    for (int d = s.nd - 1; d >= 0; --d) {
        int q = i % s.dims[d];
        i /= s.dims[d];
        oa += q * s.sa[d];
    }
    return oa;
}

// Block-wide sum/max of one value per thread; every thread gets the result. `sh` has
// blockDim.x entries; blockDim.x is a power of two.
template <typename T>
__device__ __forceinline__ T tg_block_sum(T v, T* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (t < s) sh[t] = sh[t] + sh[t + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float tg_block_max(float v, float* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (t < s) sh[t] = fmaxf(sh[t], sh[t + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// One logit row l[0..V) per block: its max, then sum_j exp(l[j] - max) (each exp also
// stored to o[j] when o is not null). The loss kernels' softmax denominators.
__device__ __forceinline__ float tg_row_max(const float* l, int V, float* sh) {
    float mx = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, l[j]);
    return tg_block_max(mx, sh);
}

__device__ __forceinline__ float tg_row_exp_sum(const float* l, float mx, int V, float* sh,
                                                float* o) {
    float acc = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float e = expf(__fsub_rn(l[j], mx));
        if (o) o[j] = e;
        acc = __fadd_rn(acc, e);
    }
    return tg_block_sum(acc, sh);
}

// IEEE half -> float without cuda_fp16.h: the PTX conversion is exact.
// TG_HOST: the CPU executor's C++ versions of the inline PTX (toygraph/ops/include/host_shim.h).
__device__ __forceinline__ float tg_half_to_float(unsigned short h) {
#ifdef TG_HOST
    return tg_host::half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ float tg_bf16_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// f32 -> bf16, round to nearest even (cvt.rn.bf16.f32's result, in integer arithmetic so
// every module compiles for any arch): how --precision bf16 stores an activation.
__device__ __forceinline__ unsigned short tg_float_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;   // NaN stays NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element i of an activation buffer that cuda/bf16_storage.py kept in f32 or, under --precision
// bf16, in bf16: bit j of a kernel's `bf16` argument says which for its operand j (bit
// TG_OUT_BF16 for its output). The branch is uniform across the grid.
#define TG_OUT_BF16 16
__device__ __forceinline__ float tg_ldx(const void* p, long long i, int bf16, int bit) {
    return (bf16 >> bit) & 1 ? tg_bf16_to_float(((const unsigned short*)p)[i])
                             : ((const float*)p)[i];
}

__device__ __forceinline__ void tg_stx(void* p, long long i, float v, int bf16) {
    if ((bf16 >> TG_OUT_BF16) & 1)
        ((unsigned short*)p)[i] = tg_float_to_bf16(v);
    else
        ((float*)p)[i] = v;
}

// Little-endian f16 at an arbitrary (possibly odd) byte address.
__device__ __forceinline__ float tg_load_half(const unsigned char* p) {
    return tg_half_to_float((unsigned short)(p[0] | (p[1] << 8)));
}

// numpy's sigmoid: exp of a non-positive argument only.
__device__ __forceinline__ float tg_sigmoid(float x) {
    float e = expf(-fabsf(x));
    float d = __fadd_rn(1.0f, e);
    return x >= 0.0f ? __fdiv_rn(1.0f, d) : __fdiv_rn(e, d);
}

#define TG_GRID_LOOP(i, n) \
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)
