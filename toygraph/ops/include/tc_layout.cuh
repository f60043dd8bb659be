// Index math of the tensor-core matmuls (tc_matmul.cu), kept apart as plain integer
// functions so the tests can compile this file for the host and replay it through a numpy
// emulator of the warp-level mma (tests/support/mmaemu.py, tests/cuda/test_cuda_tc_matmul.py).
// Nothing here touches memory.
//
// A block computes a TC_BM x TC_BN output tile with TC_THREADS threads (8 warps, 2 x 4);
// warp w owns the TC_WM x TC_WN sub-tile at tg_tc_warp_origin(w), i.e. TC_MI x TC_NI
// mma tiles of 16 x 8. Operand tiles are staged in shared memory as [rows][k] (k
// contiguous, row stride LD elements), for A rows = m and for B rows = n.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type" and "Matrix Fragments for mma.m16n8k8", .bf16 / .tf32 rows), with
// g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group):
//   m16n8k16 bf16, A: a_i at row g + 8*[i in {2,3,6,7}], col 2t + (i&1) + 8*[i >= 4];
//                      registers hold (a0,a1) (a2,a3) (a4,a5) (a6,a7), low half first.
//                  B: b_i at k 2t + (i&1) + 8*[i >= 2], n g; registers (b0,b1) (b2,b3).
//   m16n8k8 tf32,  A: a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4).
//                  B: b0 (k t, n g) b1 (k t+4, n g).
//   C/D (f32, both shapes): c_i at row g + 8*[i >= 2], col 2t + (i&1).

// The tile constants (TC_BM, TC_BN, TC_THREADS, TC_WM, TC_WN, TC_MI = TC_WM / 16,
// TC_NI = TC_WN / 8, and per precision the k slice TC_*_BK and padded row stride TC_*_LD:
// bf16 32-deep slices, rows padded by 8 halves, tf32 16-deep, padded by 4 words, so the
// fragment loads of a warp hit 32 distinct banks) come from toygraph/ops/lowering/constants.py.

// Element idx (0 .. rows*bk-1) of a staged operand tile -> (row, k) in the tile. The 256
// threads take idx = thread + 256*i; consecutive threads walk the operand's contiguous
// axis (k when its k stride is 1, else the row axis) so global loads coalesce.
__device__ __forceinline__ void tg_tc_stage_coord(int idx, int bk, int rows, int kfast,
                                                  int& row, int& k) {
    if (kfast) {
        k = idx % bk;
        row = idx / bk;
    } else {
        row = idx % rows;
        k = idx / rows;
    }
}

__device__ __forceinline__ void tg_tc_warp_origin(int warp, int& wm, int& wn) {
    wm = (warp >> 2) * TC_WM;
    wn = (warp & 3) * TC_WN;
}

// m16n8k16 bf16: A register r (0..3) of `lane` is the pair at (row, k), (row, k + 1)
// of the 16 x 16 A tile; B register r (0..1) the pair at (n, k), (n, k + 1) of the
// 8 x 16 B tile stored n-major.
__device__ __forceinline__ void tg_bf16_a_frag(int lane, int r, int& row, int& k) {
    row = (lane >> 2) + 8 * (r & 1);
    k = 2 * (lane & 3) + 8 * (r >> 1);
}

__device__ __forceinline__ void tg_bf16_b_frag(int lane, int r, int& n, int& k) {
    n = lane >> 2;
    k = 2 * (lane & 3) + 8 * r;
}

// m16n8k8 tf32: one element per register.
__device__ __forceinline__ void tg_tf32_a_frag(int lane, int r, int& row, int& k) {
    row = (lane >> 2) + 8 * (r & 1);
    k = (lane & 3) + 4 * (r >> 1);
}

__device__ __forceinline__ void tg_tf32_b_frag(int lane, int r, int& n, int& k) {
    n = lane >> 2;
    k = (lane & 3) + 4 * r;
}

// Accumulator register r (0..3) of `lane` -> (row, col) of the 16 x 8 C tile.
__device__ __forceinline__ void tg_tc_c_frag(int lane, int r, int& row, int& col) {
    row = (lane >> 2) + 8 * (r >> 1);
    col = 2 * (lane & 3) + (r & 1);
}
