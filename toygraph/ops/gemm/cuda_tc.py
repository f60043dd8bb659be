"""The bf16 tensor-core GEMM's lowering (tc_gemm.cu): what a dense matmul runs at
--precision bf16 when the cost model prefers it to tc_matmul.cu's direct kernel
(:func:`prefers_copies`; gemm.py decides; block-format weights and tf32 keep tc_matmul.cu).

Each operand is first copied to bf16 in the GEMM's canonical layout, [matrices][rows][Kp]
with k contiguous and Kp = K rounded up to 8 (tg_tcg_to_bf16 from f32, or from an
activation kept in bf16 (cuda/bf16_storage.py) where it must be transposed, padded or scaled;
one already in that layout is read as it is); the GEMM then stages 16-byte chunks of the
copies with cp.async and reads fragments with ldmatrix.

Split-K: a 2-D product whose output tiles cannot fill the GPU (one block per SM: the
device's count, ops/lowering/device.py) and whose
k is long -- the weight gradients dW = x^T dy, LoRA's dA and dB (K = tokens), the head's
dh (K = vocab) -- runs ``splits`` blocks per tile over consecutive k ranges, each writing
its partial product to scratch, and tg_tcg_sum_splits adds them in split order. The
split count is a function of the shape alone, so a step is bit-identical run to run.

Scratch (bytes, 256-aligned regions): the A copy, the B copy, then the split partials
[splits, M, N] f32 when splits > 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from toygraph.errors import CudaError
from toygraph.ops.lowering import (FORMAT_KERNELS, MAX_ELEMENTS, MAX_GRID_YZ, Launch, f32_arg,
                                   grid_1d, i32_arg, ptr_arg, sm_count, strided)
from toygraph.ops.lowering.constants import TC_BF16_BK, TC_BM, TC_BN, TC_THREADS

#: Fewest k slices (of TC_BF16_BK, 128 k) one split handles, so its pipeline fills and its
#: partial's store and sum stay small against its mma work.
MIN_SPLIT_SLICES = 4
#: k of the canonical copies is padded to a multiple of this: whole 16-byte cp.async chunks.
K_ALIGN = 8
#: A kernel's ``bf16`` argument with the output bit set (common.cuh's TG_OUT_BF16).
OUT_BF16 = 1 << 16


def _align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def split_count(tiles: int, k: int, sms: int | None = None) -> int:
    """Splits of k for a product of ``tiles`` output tiles and inner dimension ``k``: enough
    for one block per SM (``sms``, default the device's: a GEMM should launch that many to
    fill the GPU), each split at least MIN_SPLIT_SLICES slices, and no split left empty."""
    target = sm_count() if sms is None else sms
    slices = -(-k // TC_BF16_BK)
    if tiles <= 0 or tiles >= target:
        return 1
    want = min(-(-target // tiles), slices // MIN_SPLIT_SLICES)
    if want <= 1:
        return 1
    per = -(-slices // want)
    return -(-slices // per)


@dataclass(frozen=True)
class Gemm:
    """One bf16 GEMM C[nbatch, M, N] = A(m, k) B(k, n) with A(m, k) = a[m*sam + k*sak] and
    B(k, n) = b[k*sbk + n*sbn] per matrix; ``na``/``nb`` the matrices a and b hold, and the
    batch walk (dims, a's and b's matrix strides in f32 elements) as gemm.matmul_batch
    gives it."""
    M: int
    N: int
    K: int
    sam: int
    sak: int
    sbk: int
    sbn: int
    na: int = 1
    nb: int = 1
    nbatch: int = 1
    dims: tuple = ()
    sa: tuple = ()
    sb: tuple = ()

    @property
    def kp(self) -> int:
        return -(-self.K // K_ALIGN) * K_ALIGN

    @property
    def tiles(self) -> tuple[int, int]:
        return -(-self.N // TC_BN), -(-self.M // TC_BM)

    @property
    def splits(self) -> int:
        gx, gy = self.tiles
        return split_count(gx * gy, self.K) if self.nbatch == 1 else 1

    def regions(self) -> tuple[int, int, int]:
        """Bytes of scratch for the A copy, the B copy and the split partials."""
        parts = 4 * self.splits * self.M * self.N if self.splits > 1 else 0
        return (_align(2 * self.na * self.M * self.kp), _align(2 * self.nb * self.N * self.kp),
                _align(parts))

    def scratch(self) -> int:
        return sum(self.regions())


#: The cost model's view of the two bf16 GEMMs (bench/studies/roofline.py: H100 SXM dense bf16
#: peak over HBM bandwidth, 989 TFLOP/s / 3.35 TB/s, and each kernel's ASSUMED (compute,
#: memory) efficiency), used only to pick between them until a GPU measures both.
RIDGE_FLOPS_PER_BYTE = 989 / 3.35
DIRECT_EFF = (0.45, 0.70)    # tc_matmul.cu: f32 operands read and rounded in the tile loop
COPIES_EFF = (0.55, 0.75)    # this GEMM: bf16 copies, cp.async, ldmatrix, split-K
LAUNCH_FLOPS = 1e-6 * 989e12  # a launch of a replayed CUDA graph, ~1 us, in peak flops


#: tc_matmul.cu's block-format kernels: B decoded per element inside the tile loop.
BLOCKS_DIRECT_EFF = (0.30, 0.70)


def prefers_copies(g: Gemm, b_bytes: int | None = None, epilogue: bool = False,
                   scaled_a: bool = False) -> bool:
    """Whether this GEMM (its copies, 8 bytes per operand element: f32 read, bf16 written
    and read again, and split-K) is modelled faster than tc_matmul.cu's direct kernel (4
    bytes per operand element, one block per tile, no split). Skinny, memory-bound
    products (a LoRA x A^T: N = rank) lose by the copies' bytes; long-k products with
    few tiles (weight gradients, the head's dh) and large square ones win by split-K and
    the faster pipeline. ``b_bytes``: B is a block-format weight of that many bytes, which
    the direct kernels decode per element in the tile loop and the copies decode once
    (tg_tcg_deq_*). ``epilogue``: a matmul_add, whose add the copies path reads in its
    store and the direct path runs as one more pass (read out and add, write out);
    ``scaled_a``: a scale_a product, whose scale the copies path applies in its copy and
    the direct path as a pass of its own (read a, write its scaled copy).
    Times in units of one SM's share of the peak per flop."""
    M, N, K, kp = g.M, g.N, g.K, g.kp
    gx, gy = g.tiles
    tiles = gx * gy * g.nbatch
    sms = sm_count()
    out = g.nbatch * M * N
    tile = 2.0 * TC_BM * TC_BN

    def seconds(eff, waves, slices_per_tile, nbytes):
        compute = waves * tile * slices_per_tile * TC_BF16_BK / (eff[0] / sms)
        return max(compute, nbytes * RIDGE_FLOPS_PER_BYTE / eff[1])

    slices = -(-kp // TC_BF16_BK)
    s = g.splits
    a_elems, b_elems = g.na * M * K, g.nb * N * K
    if b_bytes is None:
        eff, direct_b, copy_b = DIRECT_EFF, 4 * b_elems, 8 * b_elems
    else:   # the block bytes once, then the bf16 copy written and read
        eff, direct_b, copy_b = BLOCKS_DIRECT_EFF, b_bytes, b_bytes + 4 * b_elems
    direct = seconds(eff, -(-tiles // sms), slices, 4 * (a_elems + out) + direct_b)
    copies = seconds(COPIES_EFF, -(-tiles * s // sms), -(-slices // s),
                     8 * a_elems + copy_b + 4 * out * (2 * s + 1 if s > 1 else 1))
    copies += (3 if s > 1 else 2) * LAUNCH_FLOPS     # the copies and the split sum
    if epilogue:
        direct += 12 * out * RIDGE_FLOPS_PER_BYTE / DIRECT_EFF[1] + LAUNCH_FLOPS
        copies += 4 * out * RIDGE_FLOPS_PER_BYTE / COPIES_EFF[1]
    if scaled_a:
        direct += 8 * a_elems * RIDGE_FLOPS_PER_BYTE / DIRECT_EFF[1] + LAUNCH_FLOPS
    return copies < direct


def canonical(rows: int, k: int, sr: int, sk: int, mats: tuple) -> bool:
    """Whether a bf16 operand (rows x k per matrix, X(r, k) at r*sr + k*sk, matrices at the
    strides ``mats``) already is its GEMM copy: k contiguous, rows k apart, k a multiple of
    K_ALIGN (so Kp = k and no padding) and whole matrices apart."""
    return sk == 1 and sr == k and k % K_ALIGN == 0 and all(m % (rows * k) == 0 for m in mats)


def k_major(rows: int, k: int, sr: int, sk: int) -> bool:
    """Whether a bf16 operand (X(r, k) at r*sr + k*sk) can be read k-major as it lies by
    tg_tcg_gemm_{ta,tb,tab}_bf16: r contiguous, rows of k sk apart, sk a multiple of
    K_ALIGN (whole 16-byte chunks, none past the tensor's end)."""
    return sr == 1 and sk >= rows and sk % K_ALIGN == 0 and k > 0


def bf16_copy(dst: int, src: int, rows: int, k: int, kp: int, sr: int, sk: int,
              what: str) -> list[Launch]:
    """The launch writing X(r, k) = src[r*sr + k*sk] (f32) as a bf16 GEMM copy [rows][kp]
    at ``dst``: for operands a node keeps through several GEMMs (the fused head's W)."""
    return _copy(dst, src, rows, k, kp, sr, sk, 1, what)


def _copy(dst: int, src: int, rows: int, k: int, kp: int, sr: int, sk: int, nmat: int,
          what: str, scale: float = 1.0, bf16: bool = False) -> list[Launch]:
    if rows * kp * nmat == 0:
        return []
    if nmat * rows * max(k, kp) > MAX_ELEMENTS or -(-rows // 32) > MAX_GRID_YZ:
        raise CudaError(f"{what}: a {nmat} x {rows} x {k} operand exceeds the bf16 GEMM's "
                        "int indexing")
    grid = (-(-kp // 32), -(-rows // 32), min(nmat, MAX_GRID_YZ))
    return [Launch("tg_tcg_to_bf16", grid, [ptr_arg(dst), ptr_arg(src), i32_arg(rows), i32_arg(k),
                                            i32_arg(kp), i32_arg(sr), i32_arg(sk), i32_arg(nmat),
                                            i32_arg(rows * k), f32_arg(scale), i32_arg(bf16)])]


#: The kernels decoding a block-format weight into the bf16 B copy, by direction: patterns
#: of FORMAT_KERNELS ("nt": the copy is W's rows, "nn": its columns).
DEQ_KERNELS = {"nt": "tg_tcg_deq_nt_<fmt>", "nn": "tg_tcg_deq_nn_<fmt>"}


def deq_launch(storage: str, kind: str, dst: int, w: int, rows: int, k: int, kp: int,
               row_bytes: int) -> Launch:
    """tg_tcg_deq_nt_<fmt> / tg_tcg_deq_nn_<fmt>: the block-format weight at ``w`` decoded
    into the bf16 B copy [rows][kp] at ``dst`` ("nt": rows of W, "nn": its columns)."""
    return Launch(FORMAT_KERNELS[DEQ_KERNELS[kind]][storage], (-(-kp // 32), -(-rows // 32), 1),
                  [ptr_arg(dst), ptr_arg(w), i32_arg(rows), i32_arg(k), i32_arg(kp),
                   i32_arg(row_bytes)])


#: The GEMM by which operands it reads k-major as they lie (a, b): neither, a (ta), b (tb),
#: both (tab).
K_MAJOR_GEMMS = {(False, False): "tg_tcg_gemm_bf16", (True, False): "tg_tcg_gemm_ta_bf16",
                 (False, True): "tg_tcg_gemm_tb_bf16", (True, True): "tg_tcg_gemm_tab_bf16"}


def dual_gemm_launches(g: Gemm, g2: Gemm, out: int, a: int, b: int, a2: int, b2: int,
                       scratch: int, what: str, b_copy=None, b2_copy=None,
                       scale2: float = 1.0,
                       a_bf16: bool = False, b_bf16: bool = False, a2_bf16: bool = False,
                       b2_bf16: bool = False, out_bf16: bool = False) -> list[Launch]:
    """out = A B^T + scale2 * A2 B2^T for two unbatched products of one output shape, in one
    accumulation (tg_tcg_gemm2_bf16): the launches, with g.scratch() + g2.scratch() bytes at
    ``scratch``. scale2 goes into the B2 copy, so a B2 decoded by ``b2_copy`` (a
    block-format weight) takes none; the rest as :func:`gemm_launches`."""
    M, N = g.M, g.N
    if (g2.M, g2.N) != (M, N) or g.nbatch != 1 or g2.nbatch != 1:
        raise CudaError(f"{what}: a dual GEMM needs two unbatched products of one shape")
    if M * N == 0:
        return []
    ra, rb, _ = g.regions()
    ra2, _, _ = g2.regions()
    ac, bc = scratch, scratch + ra
    ac2, bc2 = bc + rb, bc + rb + ra2
    a_as_is = a_bf16 and canonical(M, g.K, g.sam, g.sak, g.sa)
    a2_as_is = a2_bf16 and canonical(M, g2.K, g2.sam, g2.sak, g2.sa)
    b_as_is = b_bf16 and not b_copy and canonical(N, g.K, g.sbn, g.sbk, g.sb)
    launches = [] if a_as_is else _copy(ac, a, M, g.K, g.kp, g.sam, g.sak, 1, what, bf16=a_bf16)
    if b_copy:
        launches.append(b_copy(bc))
    elif not b_as_is:
        launches += _copy(bc, b, N, g.K, g.kp, g.sbn, g.sbk, 1, what, bf16=b_bf16)
    if not a2_as_is:
        launches += _copy(ac2, a2, M, g2.K, g2.kp, g2.sam, g2.sak, 1, what, bf16=a2_bf16)
    if b2_copy:
        if scale2 != 1.0:
            raise CudaError(f"{what}: a dual GEMM cannot scale a decoded block-format B")
        launches.append(b2_copy(bc2))
    else:
        launches += _copy(bc2, b2, N, g2.K, g2.kp, g2.sbn, g2.sbk, 1, what, scale2, b2_bf16)
    gx, gy = g.tiles
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{what}: {M} rows exceed the kernel's grid limit")
    slices = -(-g.kp // TC_BF16_BK) + -(-g2.kp // TC_BF16_BK)
    launches.append(Launch("tg_tcg_gemm2_bf16", (gx, gy, 1),
                           [ptr_arg(out), ptr_arg(a if a_as_is else ac),
                            ptr_arg(b if b_as_is else bc), i32_arg(M), i32_arg(N), i32_arg(g.kp),
                            i32_arg(1), i32_arg(slices), i32_arg(1), strided([], [], []),
                            ptr_arg(0), f32_arg(1.0), i32_arg(OUT_BF16 if out_bf16 else 0),
                            ptr_arg(a2 if a2_as_is else ac2), ptr_arg(bc2), i32_arg(g2.kp)],
                           block=(TC_THREADS, 1, 1)))
    return launches


def gemm_launches(g: Gemm, out: int, a: int, b: int, scratch: int, what: str,
                  b_copy=None, add: int = 0, alpha: float = 1.0,
                  a_scale: float = 1.0, a_bf16: bool = False,
                  b_bf16: bool = False, out_bf16: bool = False,
                  add_bf16: bool = False) -> list[Launch]:
    """The launches of ``g`` writing f32 C at ``out`` from f32 operands at ``a`` and ``b``,
    with g.scratch() bytes at ``scratch``; ``b_copy(dst)``, if given, makes the launch that
    writes the B copy instead (a block-format weight's deq_launch). ``add`` (an address,
    0: none): the matmul_add epilogue, out = add + alpha * C, in the GEMM's store or, when
    k is split, in the split sum. ``a_scale``: the A copy holds bf16(a_scale * a), a
    rounded to f32 after the scale (matmul's scale_a). ``a_bf16`` / ``b_bf16``: that
    operand is kept in bf16 (cuda/bf16_storage.py): read as it is when it already has the copy's
    layout (:func:`canonical`) or lies k-major (:func:`k_major`, one matrix: the ta/tb/tab
    kernels) -- a_scale then multiplies the product in the store, one more rounding than
    the scaled copy but no pass over a -- else copied from bf16; ``out_bf16``:
    C is stored in bf16
    (by the GEMM's store, or the split sum's); ``add_bf16``: the added tensor is read in
    bf16."""
    M, N, K, kp = g.M, g.N, g.K, g.kp
    if M * N * g.nbatch == 0:
        return []
    ra, rb, _ = g.regions()
    ac, bc, parts = scratch, scratch + ra, scratch + ra + rb
    a_as_is = a_bf16 and canonical(M, K, g.sam, g.sak, g.sa)
    b_as_is = b_bf16 and not b_copy and canonical(N, K, g.sbn, g.sbk, g.sb)
    one = g.nbatch == 1 and g.na == 1 and g.nb == 1   # the k-major GEMMs take one matrix
    a_km = one and a_bf16 and not a_as_is and k_major(M, K, g.sam, g.sak)
    b_km = one and b_bf16 and not b_as_is and not b_copy and k_major(N, K, g.sbn, g.sbk)
    if a_as_is or a_km:   # a bf16 operand read as it is scales the product in the store
        alpha, a_scale = alpha * a_scale, 1.0
    ac, bc = (a if a_as_is or a_km else ac), (b if b_as_is or b_km else bc)
    gx, gy = g.tiles
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{what}: {M} rows exceed the kernel's grid limit")
    # batch strides of a and b count f32 matrices of M*K / K*N; the copies' are M*kp / N*kp
    sa = [s // (M * K) * M * kp if M * K else 0 for s in g.sa]
    sb = [s // (K * N) * N * kp if K * N else 0 for s in g.sb]
    splits = g.splits
    slices = -(-kp // TC_BF16_BK)
    per = -(-slices // splits) if splits > 1 else max(1, slices)
    dst = parts if splits > 1 else out
    launches = [] if a_as_is or a_km else _copy(ac, a, M, K, kp, g.sam, g.sak, g.na, what,
                                                a_scale, a_bf16)
    if b_copy:
        launches.append(b_copy(bc))
    elif not (b_as_is or b_km):
        launches += _copy(bc, b, N, K, kp, g.sbn, g.sbk, g.nb, what, bf16=b_bf16)
    zs = g.nbatch * splits          # grid z up to MAX_GRID_YZ, the rest folded into x
    gz = max(1, min(zs, MAX_GRID_YZ))
    args = [ptr_arg(dst), ptr_arg(ac), ptr_arg(bc), i32_arg(M), i32_arg(N), i32_arg(kp),
            i32_arg(splits), i32_arg(per), i32_arg(g.nbatch), strided(list(g.dims), sa, sb),
            ptr_arg(add if splits == 1 else 0), f32_arg(alpha if splits == 1 else 1.0),
            i32_arg((OUT_BF16 if out_bf16 and splits == 1 else 0) | add_bf16)]
    name = K_MAJOR_GEMMS[bool(a_km), bool(b_km)]
    if a_km or b_km:   # read k-major as it lies: the true k, the operands' row strides
        args += [i32_arg(K), i32_arg(g.sak if a_km else 0), i32_arg(g.sbk if b_km else 0)]
    launches.append(Launch(name, (gx * -(-zs // gz), gy, gz), args, block=(TC_THREADS, 1, 1)))
    if splits > 1:
        launches.append(Launch("tg_tcg_sum_splits", grid_1d(M * N),
                               [ptr_arg(out), ptr_arg(parts), i32_arg(splits), i32_arg(M * N),
                                ptr_arg(add), f32_arg(alpha),
                                i32_arg((OUT_BF16 if out_bf16 else 0) | add_bf16)]))
    return launches
