"""The CUDA lowering of the gemm family (kernels in dequant.cu, matmul.cu, qmatmul.cu,
tc_async.cuh, tc_gemm.cu, tc_layout.cuh, tc_matmul.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from math import prod
from typing import NamedTuple

from toygraph.errors import CudaError
from toygraph.ops.elementwise.cuda import grid_vec, vector_ok
from toygraph.ops.gemm.cuda_tc import (Gemm, deq_launch, dual_gemm_launches, gemm_launches,
                                       prefers_copies)
from toygraph.ops.lowering import (FORMAT_KERNELS, MAX_GRID_YZ, At, Launch, contiguous_strides,
                                   declare_kernels, decodes, f32_arg, grid_1d, i32_arg, lowers,
                                   pad_shape, ptr_arg, strided)
from toygraph.ops.lowering.constants import MM_BM, MM_THREADS, TC_BM, TC_THREADS
from toygraph.precision import TENSOR_CORE_PRECISIONS

# The family's CUDA kernels, beside this module: f32 tiles, block-format weights read in
# the matmul (qmatmul.cu uses matmul.cu's tile helper), the dequantizers, and the
# tensor-core tiles, compiled only into the bf16/tf32 modules.
declare_kernels(__file__, "matmul.cu", "dequant.cu")
declare_kernels(__file__, "qmatmul.cu", needs=("matmul.cu",))
declare_kernels(__file__, "tc_layout.cuh", precisions=TENSOR_CORE_PRECISIONS)
declare_kernels(__file__, "tc_matmul.cu", needs=("tc_layout.cuh",),
                precisions=TENSOR_CORE_PRECISIONS)
declare_kernels(__file__, "tc_gemm.cu", needs=("tc_matmul.cu", "tc_async.cuh"),
                precisions=TENSOR_CORE_PRECISIONS)


#: The kernels that read a weight in its block format, by direction: "nt" y = x @ W^T, "nn"
#: dx = dy @ W (qmatmul.cu). Each is a pattern of FORMAT_KERNELS, the kernels the .cu
#: files define once per block format, spelled out there: FORMAT_KERNELS[pattern][fmt].
QMM_KERNELS = {"nt": "tg_qmm_nt_<fmt>", "nn": "tg_qmm_nn_<fmt>"}


#: Tensor-core kernels per precision (tc_matmul.cu): "matmul" takes tg_matmul's arguments,
#: "nt"/"nn" a block-format weight's (QMM_KERNELS'), patterns of FORMAT_KERNELS. At bf16
#: a dense matmul the cost model prefers it for runs tc_gemm.cu's GEMM instead
#: (BF16_GEMM_KERNELS).
TC_KERNELS: dict[str, dict[str, str]] = {
    "bf16": {"matmul": "tg_tc_matmul_bf16", "nt": "tg_tc_qmm_nt_<fmt>_bf16",
             "nn": "tg_tc_qmm_nn_<fmt>_bf16"},
    "tf32": {"matmul": "tg_tc_matmul_tf32", "nt": "tg_tc_qmm_nt_<fmt>_tf32",
             "nn": "tg_tc_qmm_nn_<fmt>_tf32"},
}


#: The precision whose dense matmuls run tc_gemm.cu, and its kernels (with each block
#: format's decoders into the B copy, tg_tcg_deq_nt_<fmt> / tg_tcg_deq_nn_<fmt>).
BF16_GEMM_PRECISION = "bf16"

BF16_GEMM_KERNELS = ("tg_tcg_to_bf16", "tg_tcg_gemm_bf16", "tg_tcg_gemm2_bf16", "tg_tcg_gemm_ta_bf16",
                     "tg_tcg_gemm_tb_bf16", "tg_tcg_gemm_tab_bf16", "tg_tcg_sum_splits",
                     *FORMAT_KERNELS["tg_tcg_deq_nt_<fmt>"].values(),
                     *FORMAT_KERNELS["tg_tcg_deq_nn_<fmt>"].values())


#: Output tile edge of the tensor-core kernels (square: TC_BM == TC_BN, checked by a test;
#: so are the f32 tiles, MM_BM == MM_BN).
TC_TILE = TC_BM


def matmul_batch(a_shape, b_shape, out_batch):
    """(dims, a strides, b strides) over the output batch axes; grouped axes are split into
    (kv heads, group) with b's group stride 0, like the numpy kernel's reshape."""
    n = len(out_batch)
    ab, bb = pad_shape(a_shape[:-2], n), pad_shape(b_shape[:-2], n)
    a_cs = contiguous_strides(pad_shape(a_shape, n + 2))[:n]
    b_cs = contiguous_strides(pad_shape(b_shape, n + 2))[:n]
    dims, sa, sb = [], [], []
    for o, x, y, ca, cb in zip(out_batch, ab, bb, a_cs, b_cs):
        xa = ca if x == o else 0
        if y == o or y == 1:
            dims.append(o), sa.append(xa), sb.append(cb if y == o else 0)
        else:
            g = o // y
            dims += [y, g]
            sa += [xa * g, xa]
            sb += [cb, 0]
    return dims, sa, sb


def matmul_geometry(node):
    """(M, N, K, sam, sak, sbk, sbn, nbatch, batch dims, a strides, b strides) of a dense
    matmul: A(m, k) = a[m*sam + k*sak], B(k, n) = b[k*sbk + n*sbn], plus the batch walk."""
    (x, y), ta, tb = node.srcs[-2:], node.attrs["trans_a"], node.attrs["trans_b"]
    M, N = node.shape[-2], node.shape[-1]
    K = x.shape[-2] if ta else x.shape[-1]
    sam, sak = (1, M) if ta else (K, 1)
    sbk, sbn = (1, K) if tb else (N, 1)
    out_batch = node.shape[:-2]
    nbatch = prod(out_batch)
    dims, sa, sb = matmul_batch(x.shape, y.shape, out_batch)
    return M, N, K, sam, sak, sbk, sbn, nbatch, dims, sa, sb


def _row_tiles(what: str, M: int, tile: int) -> int:
    """Tiles over M rows (grid y), or CudaError when they exceed the grid limit."""
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{what}: {M} rows exceed the kernel's grid limit")
    return gy


def _matmul(node, out, ptr, tile: int = MM_BM, kernel: str = "tg_matmul",
            threads: int = MM_THREADS) -> Launch:
    M, N, K, sam, sak, sbk, sbn, nbatch, dims, sa, sb = matmul_geometry(node)
    x, y = node.srcs[-2:]
    gy = _row_tiles(f"matmul {node.name!r}", M, tile)
    grid = ((N + tile - 1) // tile, gy, max(1, min(nbatch, MAX_GRID_YZ)))
    return Launch(kernel, grid, [ptr_arg(out), ptr_arg(ptr(x)), ptr_arg(ptr(y)), i32_arg(M),
                                 i32_arg(N), i32_arg(K), i32_arg(sam), i32_arg(sak), i32_arg(sbk),
                                 i32_arg(sbn), i32_arg(nbatch),
                                 strided(dims, sa, sb)], block=(threads, 1, 1))


def matmul_gemm(node) -> Gemm:
    """A dense matmul node as tc_gemm's Gemm (its batch walk from matmul_geometry)."""
    M, N, K, sam, sak, sbk, sbn, nbatch, dims, sa, sb = matmul_geometry(node)
    x, y = node.srcs[-2:]
    return Gemm(M, N, K, sam, sak, sbk, sbn, na=x.size // (M * K) if M * K else 0,
                nb=y.size // (K * N) if K * N else 0, nbatch=nbatch, dims=tuple(dims),
                sa=tuple(sa), sb=tuple(sb))


def _picks_copies(node, g: Gemm, b_bytes: int | None = None) -> bool:
    """Whether the cost model runs this product as tc_gemm.cu's GEMM on copies (at bf16),
    given what the node adds to the direct kernels: matmul_add's epilogue pass, scale_a's
    prescaling pass (both free on the copies path)."""
    return prefers_copies(g, b_bytes, epilogue=node.op == "matmul_add",
                          scaled_a=_scale_a(node) != 1.0)


def _scale_a(node) -> float:
    return node.attrs.get("scale_a", 1.0)


def _prescaled_bytes(node) -> int:
    """Scratch for scale_a * a where the product's kernel cannot scale its operand."""
    return 0 if _scale_a(node) == 1.0 else (4 * node.srcs[-2].size + 255) // 256 * 256


def _matmul_scratch(node, precision: str) -> int:
    """The bf16 GEMM's operand copies and split partials (tc_gemm.py), or a prescaled a
    (scale_a) before any other kernel. Room for both ways a block-format b may be read
    (the memory plan decides later): dense (matmul_gemm) and decoded once (block_gemm,
    batch folded into M, so it may split k where the batched dense walk does not).
    Scratch is one buffer shared by every node, so this only raises its size to the
    largest node's. At bf16 the copies' room is kept whatever the cost model picks: an
    operand kept in bf16 (decided after scratch, cuda/bf16_storage.py) always takes tc_gemm.cu."""
    direct = _prescaled_bytes(node)
    if precision != BF16_GEMM_PRECISION:
        return direct
    g = matmul_gemm(node)
    need = max(g.scratch(), direct)
    if _decodes_once(node):
        need = max(need, block_gemm(node).scratch())   # batch folded into M: its own split
    if _absorbs(node, precision) is not None:          # the dual GEMM: both products' copies
        need = max(need, max(_base_gemms(node.srcs[0]), key=Gemm.scratch).scratch()
                   + g.scratch())
    return need


def _decodes_once(node) -> bool:
    """Whether the product's weight may be a block-format const decoded once at bf16."""
    w = node.srcs[-1]
    return (_weight_in_blocks(node, len(node.srcs) - 1) and w.role == "const"
            and w.storage in FORMAT_KERNELS["tg_deq_<fmt>"])


def _base_gemms(base) -> list[Gemm]:
    """The Gemms a product may run as: dense, and decoded once if its weight may be."""
    return [matmul_gemm(base)] + ([block_gemm(base)] if _decodes_once(base) else [])


def _absorbs(node, precision: str):
    """matmul_add's base product -- x W^T of a LoRA projection, dy W of its backward --
    computed in its own GEMM at bf16 (tg_tcg_gemm2_bf16: one accumulation over both
    products' k, the base output never written apart): both unbatched, 2-D operands, the
    base unscaled and too large to split k, and the scale of the other product free to go
    into its B copy (not a block-format weight's decode). None otherwise (cuda/bf16_storage.py
    then also checks that the base is an intermediate read only here)."""
    base = node.srcs[0]
    if (precision != BF16_GEMM_PRECISION or base.op != "matmul" or _scale_a(base) != 1.0
            or any(len(t.shape) != 2 for t in (base, *base.srcs, *node.srcs[1:]))
            or (_decodes_once(node) and node.attrs["alpha"] * _scale_a(node) != 1.0)):
        return None
    if any(g.splits != 1 for g in _base_gemms(base)) or matmul_gemm(node).nbatch != 1:
        return None
    return base


def _prescale(node, at) -> tuple[list[Launch], At]:
    """For a product with scale_a whose kernel reads a as it is: scale_a * a into the front
    of scratch (tg_scale's arithmetic, the unfused scale node's), and where the node's
    launches then read a and their own scratch. Nothing for a product without scale_a."""
    if _scale_a(node) == 1.0:
        return [], at
    a, dst = node.srcs[-2], at.scratch
    src, n = at.ptr(a), a.size
    name, grid = ("tg_scale_vec", grid_vec(n)) if vector_ok(dst, src) else ("tg_scale", grid_1d(n))
    ptr = at.ptr
    return ([Launch(name, grid, [ptr_arg(dst), ptr_arg(src), i32_arg(n),
                                 f32_arg(_scale_a(node))])],
            at._replace(ptr=lambda t: dst if t is a else ptr(t),
                        scratch=at.scratch + _prescaled_bytes(node)))


def block_gemm(node) -> Gemm:
    """x @ W^T / dy @ W with W a block-format weight, as tc_gemm's Gemm (x's batch axes
    folded into M; B's strides unused: tg_tcg_deq_* writes its copy)."""
    (x, w), tb = node.srcs[-2:], node.attrs["trans_b"]
    K = x.shape[-1]
    return Gemm(x.size // K if K else 0, w.shape[0] if tb else w.shape[1], K, K, 1, 0, 0)


def row_bytes(w) -> int:
    """Bytes of one row of the 2-D block-format const ``w``."""
    from toygraph.gguf import blocks
    return blocks.nbytes(w.storage, (1, w.shape[1]))


def _qmatmul(node, out, ptr, tile: int = MM_BM) -> Launch:
    """x @ W^T (trans_b) or dy @ W on a block-format W [rows, cols]; x's batch axes fold
    into M since the 2-D W is shared by every batch entry and all buffers are contiguous."""
    (x, w), tb = node.srcs[-2:], node.attrs["trans_b"]
    K = x.shape[-1]
    M = x.size // K if K else 0
    N = w.shape[0] if tb else w.shape[1]
    if K != (w.shape[1] if tb else w.shape[0]):
        raise CudaError(f"matmul {node.name!r}: inner dimensions {x.shape} and {w.shape} differ")
    gy = _row_tiles(f"matmul {node.name!r}", M, tile)
    kernel = FORMAT_KERNELS[QMM_KERNELS["nt" if tb else "nn"]][w.storage]
    return Launch(kernel, (max(1, (N + tile - 1) // tile), max(1, gy), 1),
                  [ptr_arg(out), ptr_arg(ptr(x)), ptr_arg(ptr(w)), i32_arg(M), i32_arg(N),
                   i32_arg(K), i32_arg(row_bytes(w))],
                  block=(MM_THREADS, 1, 1))


def _weight_in_blocks(node, index: int) -> bool:
    """A matmul (or matmul_add) reads its b, the last source, in block format as the weight
    of ``x @ W^T`` / ``dy @ W``: a 2-D b, trans_a=False, a's batch axes folded into M."""
    a, b = node.srcs[-2:]
    return (index == len(node.srcs) - 1 and b.ndim == 2 and a is not b
            and not node.attrs["trans_a"])


# --- the dispatcher: which kernels a product runs, and why ------------------------------------
class Route(NamedTuple):
    kernels: str     # what it launches, spelled as the .cu files name them
    why: str         # when the dispatcher takes it
    epilogue: bool   # matmul_add's add + alpha * product is done inside (tc_gemm.cu's store)


#: Every way a matmul or matmul_add runs, in the order the dispatcher tries them: the first
#: whose condition (in ``route``) holds is taken. <fmt> is a GGUF block format, <p> bf16/tf32.
ROUTES = {
    "dual": Route("tg_tcg_gemm2_bf16", "bf16 matmul_add that absorbs its base product "
                  "(_absorbs): both products in one accumulation", True),
    "qmm": Route("tg_qmm_nt_<fmt> / tg_qmm_nn_<fmt>", "f32, the weight kept in its blocks", False),
    "f32": Route("tg_matmul", "f32, dense operands", False),
    "bf16_block": Route("tg_tcg_deq_nt_<fmt> / tg_tcg_deq_nn_<fmt> + tg_tcg_gemm*_bf16",
                        "bf16, the weight in its blocks, decoded once into the GEMM's copy: an "
                        "operand kept in bf16, or the cost model prefers it", True),
    "bf16_dense": Route("tg_tcg_to_bf16 + tg_tcg_gemm*_bf16", "bf16, dense: an operand kept in "
                        "bf16, or the cost model prefers the GEMM on copies", True),
    "tc_block": Route("tg_tc_qmm_nt_<fmt>_<p> / tg_tc_qmm_nn_<fmt>_<p>",
                      "bf16/tf32, the weight in its blocks, read in the tile loop", False),
    "tc_dense": Route("tg_tc_matmul_<p>", "bf16/tf32, dense: tg_matmul's arguments on tensor "
                      "cores (every trans/batch/grouped-query case)", False),
}


def route(node, at) -> str:
    """The name (a key of ROUTES) of the way ``node`` runs."""
    w, precision = node.srcs[-1], at.precision
    in_blocks = w.id in at.raw_consts
    if node.op == "matmul_add" and at.absorbed.get(node.srcs[0].id) is node:
        return "dual"
    if precision == "f32":
        return "qmm" if in_blocks else "f32"
    if precision not in TC_KERNELS:
        raise CudaError(f"matmul {node.name!r}: no tensor-core kernels for precision "
                        f"{precision!r} (have {sorted(TC_KERNELS)})")
    half = _halves(node, at)
    if precision == BF16_GEMM_PRECISION and in_blocks and (any(half.values()) or _picks_copies(
            node, block_gemm(node), row_bytes(w) * w.shape[0])):
        return "bf16_block"
    if precision == BF16_GEMM_PRECISION and not in_blocks and (
            any(half.values()) or _picks_copies(node, matmul_gemm(node))):
        return "bf16_dense"
    if any(half.values()):
        raise CudaError(f"matmul {node.name!r}: an operand or output kept in bf16 needs "
                        f"precision {BF16_GEMM_PRECISION!r}'s GEMM")
    return "tc_block" if in_blocks else "tc_dense"


def _halves(node, at) -> dict:
    """Which of the product's tensors are kept in bf16 (cuda/bf16_storage.py): only tc_gemm.cu
    reads and writes them. matmul_add's add is one of them."""
    x, w = node.srcs[-2:]
    return dict(a_bf16=at.half(x), b_bf16=at.half(w), out_bf16=at.half(node),
                add_bf16=node.op == "matmul_add" and at.half(node.srcs[0]))


def _launches(name: str, node, at, add: int = 0, alpha: float = 1.0) -> list[Launch]:
    """The launches of route ``name`` (``add``, ``alpha``: matmul_add's epilogue, for the
    routes that do it inside)."""
    (x, w), s_a, ptr, what = node.srcs[-2:], _scale_a(node), at.ptr, f"matmul {node.name!r}"
    kind = "nt" if node.attrs["trans_b"] else "nn"
    if name == "dual":
        return _dual(node, at)
    if name == "bf16_block":
        g = block_gemm(node)
        half = _halves(node, at)
        return gemm_launches(g, at.out, ptr(x), 0, at.scratch, what,
                             b_copy=lambda dst: deq_launch(w.storage, kind, dst, ptr(w), g.N,
                                                           g.K, g.kp, row_bytes(w)),
                             add=add, alpha=alpha, a_scale=s_a, a_bf16=half["a_bf16"],
                             out_bf16=half["out_bf16"], add_bf16=half["add_bf16"])
    if name == "bf16_dense":
        return gemm_launches(matmul_gemm(node), at.out, ptr(x), ptr(w), at.scratch, what,
                             add=add, alpha=alpha, a_scale=s_a, **_halves(node, at))
    pre, at = _prescale(node, at)
    if name == "qmm":
        return pre + [_qmatmul(node, at.out, at.ptr)]
    if name == "f32":
        return pre + [_matmul(node, at.out, at.ptr)]
    table = TC_KERNELS[at.precision]
    if name == "tc_block":
        q = _qmatmul(node, at.out, at.ptr, tile=TC_TILE)
        return pre + [Launch(FORMAT_KERNELS[table[kind]][w.storage], q.grid, q.args,
                             block=(TC_THREADS, 1, 1))]
    return pre + [_matmul(node, at.out, at.ptr, tile=TC_TILE, kernel=table["matmul"],
                          threads=TC_THREADS)]


@lowers("matmul", kernels=("tg_matmul", "tg_scale", "tg_scale_vec"), scratch=_matmul_scratch,
        block_format=_weight_in_blocks, bf16_reads=(-2, -1), bf16_writes=True)
def _lower_matmul(node, at):
    """The launches of the route the dispatcher picks (ROUTES)."""
    return _launches(route(node, at), node, at)


# The add is read in f32: matmul_add chains are sums of gradient contributions (dx of the
# q, k, v or gate and up projections and their adapters), and a bf16 partial sum would round
# the reduction at every term. Only the product's operands may be bf16.
@lowers("matmul_add", kernels=("tg_matmul", "tg_scale", "tg_scale_vec", "tg_matmul_add_epilogue"),
        scratch=_matmul_scratch, block_format=_weight_in_blocks, bf16_reads=(1, 2),
        bf16_writes=True, absorbs=_absorbs)
def _lower_matmul_add(node, at):
    """The product by its route, and the epilogue out = add + alpha * product: inside the
    routes that do it (tc_gemm.cu's store or split sum), else tg_matmul_add_epilogue over
    the product in out."""
    name = route(node, at)
    if name == "dual":   # the base product is absorbed: it has no buffer to add from
        return _launches(name, node, at)
    add, alpha = at.ptr(node.srcs[0]), node.attrs["alpha"]
    launches = _launches(name, node, at, add, alpha)
    if ROUTES[name].epilogue:
        return launches
    return launches + [Launch("tg_matmul_add_epilogue", grid_1d(node.size),
                              [ptr_arg(at.out), ptr_arg(add), f32_arg(alpha), i32_arg(node.size)])]


def _dual(node, at) -> list[Launch]:
    """matmul_add with its base product absorbed (_absorbs): base + alpha * (s_a a) @ b as
    one dual GEMM, the base's weight decoded once when it is a block-format const."""
    base, ptr = node.srcs[0], at.ptr
    (x, w), (u, b) = base.srcs, node.srcs[1:]
    what = f"matmul {node.name!r}"
    g2 = matmul_gemm(node)
    common = dict(scale2=node.attrs["alpha"] * _scale_a(node), a2_bf16=at.half(u),
                  b2_bf16=at.half(b), out_bf16=at.half(node))
    if b.id in at.raw_consts:   # the second product's weight decoded once too
        g2 = block_gemm(node)
        kind2 = "nt" if node.attrs["trans_b"] else "nn"
        common["b2_copy"] = lambda dst: deq_launch(b.storage, kind2, dst, ptr(b), g2.N, g2.K,
                                                   g2.kp, row_bytes(b))
    if w.id in at.raw_consts:
        g = block_gemm(base)
        kind = "nt" if base.attrs["trans_b"] else "nn"
        return dual_gemm_launches(
            g, g2, at.out, ptr(x), 0, ptr(u), ptr(b), at.scratch, what, a_bf16=at.half(x),
            b_copy=lambda dst: deq_launch(w.storage, kind, dst, ptr(w), g.N, g.K, g.kp,
                                          row_bytes(w)), **common)
    return dual_gemm_launches(matmul_gemm(base), g2, at.out, ptr(x), ptr(w), ptr(u), ptr(b),
                              at.scratch, what, a_bf16=at.half(x), b_bf16=at.half(w), **common)


# --- unbatched launches for fused ops that run matmuls over raw addresses (loss.py's head) ---
def dense_mm(out, a, b, M, N, K, sam, sak, sbk, sbn, precision, kernel="tg_matmul") -> Launch:
    """One unbatched matmul launch, A(m, k) = a[m*sam + k*sak], B(k, n) = b[k*sbk + n*sbn];
    tensor-core kernels (same arguments) for ``precision`` bf16/tf32 unless ``kernel`` is
    tg_matmul_acc, which has no tensor-core twin."""
    tile, block = MM_BM, (MM_THREADS, 1, 1)
    if precision != "f32" and kernel == "tg_matmul":
        kernel, tile, block = TC_KERNELS[precision]["matmul"], TC_TILE, (TC_THREADS, 1, 1)
    gy = _row_tiles(kernel, M, tile)
    return Launch(kernel, ((N + tile - 1) // tile, gy, 1),
                  [ptr_arg(out), ptr_arg(a), ptr_arg(b), i32_arg(M), i32_arg(N), i32_arg(K),
                   i32_arg(sam), i32_arg(sak), i32_arg(sbk), i32_arg(sbn), i32_arg(1),
                   strided([], [])], block)


def block_mm(out, a, w, w_ptr, M, N, K, kind, precision) -> Launch:
    """x @ W^T ("nt") or dy @ W ("nn") with the block-format const ``w`` at ``w_ptr``, with
    _qmatmul's arguments (tensor-core twins for bf16/tf32, as _tc_matmul picks them)."""
    pattern, tile, threads = QMM_KERNELS[kind], MM_BM, MM_THREADS
    if precision != "f32":
        pattern, tile, threads = TC_KERNELS[precision][kind], TC_TILE, TC_THREADS
    kernel = FORMAT_KERNELS[pattern][w.storage]
    gy = _row_tiles(kernel, M, tile)
    return Launch(kernel, (max(1, (N + tile - 1) // tile), max(1, gy), 1),
                  [ptr_arg(out), ptr_arg(a), ptr_arg(w_ptr), i32_arg(M), i32_arg(N), i32_arg(K),
                   i32_arg(row_bytes(w))],
                  block=(threads, 1, 1))


# --- the dequantizers (dequant.cu) -------------------------------------------------------------
@decodes(*FORMAT_KERNELS["tg_deq_<fmt>"])
def dequant_launch(name: str, storage: str, out: int, raw: int, n: int) -> Launch:
    """The launch decoding ``n`` elements of const ``name`` stored as ``storage`` from its
    block bytes at ``raw`` into f32 at ``out`` (the CUDA backend's realize runs it for a
    const whose consumers cannot read its block format)."""
    return Launch(FORMAT_KERNELS["tg_deq_<fmt>"][storage], grid_1d(n),
                  [ptr_arg(out), ptr_arg(raw), i32_arg(n)])
