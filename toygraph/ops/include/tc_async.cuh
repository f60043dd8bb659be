// ldmatrix and cp.async (sm_80+) for the tensor-core kernels, as inline PTX on the GPU and
// through the host executor's emulation (toygraph/ops/include/host_shim.h: tg_host::ldmatrix, cp_async)
// on the CPU. PTX ISA semantics, summarised here for the kernels' readers:
//
// tg_ldmatrix<NM, TRANS>(d, row): ldmatrix.sync.aligned.m8n8.x{NM}{.trans}.shared.b16.
//   NM 8 x 8 matrices of 16-bit elements; lanes 8i .. 8i+7 pass the shared addresses
//   (16-byte aligned) of rows 0..7 of matrix i. d[i] of lane l = matrix i's row l / 4,
//   columns 2(l % 4), 2(l % 4) + 1 (low half first) -- exactly an mma.m16n8k16 A/B register;
//   with TRANS, the transposed matrix's (column l / 4, rows 2(l % 4) and 2(l % 4) + 1).
//
// tg_cp_async16(dst, src, src_bytes): cp.async.cg.shared.global, 16 bytes global -> shared,
//   bytes past src_bytes (0 or 16 here) zero-filled; tg_cp_async<BYTES> the .ca form for
//   4, 8 or 16 bytes. tg_cp_async_commit() closes this thread's pending copies into a
//   group; tg_cp_async_wait<N>() waits until at most the N most recent groups are pending.
//   Other threads see the data only after their own wait and a __syncthreads.

#ifndef TG_HOST
__device__ __forceinline__ unsigned tg_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#endif

template <int NM, bool TRANS>
__device__ __forceinline__ void tg_ldmatrix(unsigned* d, const void* row) {
#ifdef TG_HOST
    tg_host::ldmatrix<NM, TRANS>(d, row);
#else
    const unsigned a = tg_smem_addr(row);
    if (NM == 4 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(a));
    else if (NM == 4)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(a));
    else if (NM == 2 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                     : "=r"(d[0]), "=r"(d[1]) : "r"(a));
    else if (NM == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                     : "=r"(d[0]), "=r"(d[1]) : "r"(a));
    else if (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(d[0]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                     : "=r"(d[0]) : "r"(a));
#endif
}

__device__ __forceinline__ void tg_cp_async16(void* dst, const void* src, int src_bytes) {
#ifdef TG_HOST
    tg_host::cp_async(dst, src, 16, src_bytes, true);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(tg_smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
#endif
}

template <int BYTES>
__device__ __forceinline__ void tg_cp_async(void* dst, const void* src) {
#ifdef TG_HOST
    tg_host::cp_async(dst, src, BYTES, BYTES, false);
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;"
                 :: "r"(tg_smem_addr(dst)), "l"(src), "n"(BYTES) : "memory");
#endif
}

__device__ __forceinline__ void tg_cp_async_commit() {
#ifdef TG_HOST
    tg_host::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void tg_cp_async_wait() {
#ifdef TG_HOST
    tg_host::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
