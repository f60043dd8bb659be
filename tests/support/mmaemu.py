"""A numpy emulator of the warp-level mma.sync the tensor-core matmuls (ops/gemm/tc_matmul.cu)
run, written from the PTX ISA's fragment layouts ("Matrix Fragments for mma.m16n8k16 with
floating point type", "Matrix Fragments for mma.m16n8k8", .bf16 / .tf32 / f32 C), and a
replay of a whole tc_matmul.cu launch through it, driven by the kernels' own index math
(tc_layout.cuh compiled for the host; tests/cuda/test_cuda_tc_matmul.py)."""
import numpy as np

from support.cudaemu import walk
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph.ops.lowering.launch import MAX_GRID_YZ


# The PTX ISA's fragment layouts, written from the documentation independently of the
# kernels (g = groupID = lane >> 2, t = threadID_in_group = lane % 4). Element i of a lane.
def ptx_a(prec, lane, i):
    g, t = lane >> 2, lane % 4
    if prec == "bf16":   # m16n8k16 .bf16, a0..a7
        row = g if (i < 2 or 4 <= i < 6) else g + 8
        col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    else:                # m16n8k8 .tf32, a0..a3
        row = g if i in (0, 2) else g + 8
        col = t if i in (0, 1) else t + 4
    return row, col


def ptx_b(prec, lane, i):   # (row = k, col = n) of B [K, 8]
    g, t = lane >> 2, lane % 4
    if prec == "bf16":   # b0..b3
        return t * 2 + (i & 1) + (8 if i >= 2 else 0), g
    return (t if i == 0 else t + 4), g   # b0, b1


def ptx_c(lane, i):         # f32 accumulators c0..c3 of the 16 x 8 C/D
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


MMA_K = {"bf16": 16, "tf32": 8}


def mma_emulate(prec, a, b, c):
    """One warp's mma.sync: a [32, nA], b [32, nB], c [32, 4] per-lane element values in
    the PTX layouts -> d [32, 4]. Each documented position must be held exactly once."""
    K = MMA_K[prec]
    A, B, C = np.full((16, K), np.nan), np.full((K, 8), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(a.shape[1]):
            r, col = ptx_a(prec, lane, i)
            assert np.isnan(A[r, col]), "two lanes hold one A element"
            A[r, col] = a[lane, i]
        for i in range(b.shape[1]):
            r, col = ptx_b(prec, lane, i)
            assert np.isnan(B[r, col])
            B[r, col] = b[lane, i]
        for i in range(4):
            r, col = ptx_c(lane, i)
            assert np.isnan(C[r, col])
            C[r, col] = c[lane, i]
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any())
    D = A @ B + C
    return np.array([[D[ptx_c(lane, i)] for i in range(4)] for lane in range(32)])


def round_bf16(x):
    """cvt.rn.bf16.f32: round to nearest even, kept as the f32 with those top 16 bits."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def round_tf32(x):
    """cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x1000) & 0xFFFFE000
    return u.astype(np.uint32).view(np.float32)


ROUND = {"bf16": round_bf16, "tf32": round_tf32}


def kernel_frags(L, prec, As, Bs, ld, a_row0, b_row0, kk):
    """The registers the kernel loads (P::a_reg / P::b_reg) from flat shared tiles As/Bs
    (row stride ld) for the 16 x K A tile at row a_row0 and the 8 x K B tile at b_row0,
    expanded to per-lane elements in register order (low half first)."""
    fa, fb = L["frag"][prec]
    pair = L["pair"][prec]
    h = np.arange(pair)
    ia = (a_row0 + fa[:, :, 0, None]) * ld + kk + fa[:, :, 1, None] + h   # [32, regs, pair]
    ib = (b_row0 + fb[:, :, 0, None]) * ld + kk + fb[:, :, 1, None] + h
    return As[ia].reshape(32, -1), Bs[ib].reshape(32, -1), ia, ib


def emulate_tc_block_kernel(L, prec, out, A_at, B_at, M, N, K, akf, bkf):
    """Replay one tc_matmul.cu launch over every block in numpy: stage slices through
    the kernel's staging map (zeros outside M, N, K; rounded like cvt), run each warp's
    mma tiles through the emulator with the kernel's fragment loads, store through the
    kernel's C map with its bounds checks."""
    bk, ld, ks = L["bk"][prec], L["ld"][prec], L["kstep"][prec]
    rnd = ROUND[prec]
    BM, BN = L["BM"], L["BN"]
    ar, ak = L["stage"](bk, BM, akf)
    br, bkk = L["stage"](bk, BN, bkf)
    for m0 in range(0, M, BM):
        for n0 in range(0, N, BN):
            acc = {}
            for k0 in range(0, K, bk):
                As, Bs = np.zeros(BM * ld), np.zeros(BN * ld)
                for S, rr, kk_, R, at, r0 in ((As, ar, ak, M, A_at, m0), (Bs, br, bkk, N, B_at, n0)):
                    gr, gk = r0 + rr, k0 + kk_
                    ok = (gr < R) & (gk < K)
                    v = np.zeros(rr.size)
                    v[ok] = at(gr[ok], gk[ok])
                    S[rr * ld + kk_] = rnd(v).astype(np.float64)
                for w, (wm, wn) in enumerate(L["warps"]):
                    for i in range(L["MI"]):
                        for j in range(L["NI"]):
                            c = acc.get((w, i, j), np.zeros((32, 4)))
                            for kk in range(0, bk, ks):
                                a, b, _, _ = kernel_frags(L, prec, As, Bs, ld, wm + 16 * i,
                                                           wn + 8 * j, kk)
                                c = mma_emulate(prec, a, b, c)
                            acc[w, i, j] = c
            for (w, i, j), c in acc.items():
                wm, wn = L["warps"][w]
                for lane in range(32):
                    for r in range(4):
                        row, col = L["cfrag"][lane, r]
                        gm, gn = m0 + wm + 16 * i + row, n0 + wn + 8 * j + col
                        if gm < M and gn < N:
                            out[gm * N + gn] = c[lane, r]


def emulate_tc_launch(L, launch, mem, raw=None):
    prec = launch.kernel.rsplit("_", 1)[1]
    a = [x[0] if x.size == 1 else x for x in launch.args]
    out, x = mem[int(a[0])], mem[int(a[1])]
    if launch.kernel.startswith("tg_tc_matmul_"):
        M, N, K, sam, sak, sbk, sbn, nbatch = (int(v) for v in a[3:11])
        y = mem[int(a[2])]
        oa, ob = walk(a[11], nbatch)
        assert launch.grid[2] == min(nbatch, MAX_GRID_YZ)
        for z in range(nbatch):
            view = out[z * M * N:(z + 1) * M * N]
            emulate_tc_block_kernel(
                L, prec, view,
                lambda r, k, o=oa[z]: x[o + r * sam + k * sak],
                lambda n, k, o=ob[z]: y[o + n * sbn + k * sbk],
                M, N, K, int(sak == 1), int(sbk == 1))
    else:   # tg_tc_qmm_{nt,nn}_<fmt>_<prec>: W decoded from its blocks
        kind = launch.kernel.split("_")[3]
        M, N, K = (int(v) for v in a[3:6])
        W = raw   # the dequantized [rows, cols] weight
        Bnk = W if kind == "nt" else W.T
        emulate_tc_block_kernel(L, prec, out, lambda r, k: x[r * K + k],
                                 lambda n, k: Bnk[n, k], M, N, K, 1, int(kind == "nt"))
    assert launch.grid[:2] == (-(-int(a[4]) // L["BN"]), -(-int(a[3]) // L["BM"]))
    assert launch.block == (L["THREADS"], 1, 1)
