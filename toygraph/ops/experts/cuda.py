"""The CUDA lowering of the experts family (kernels in experts.cu, matmul.cu; its ops and their
rules are in __init__.py)."""
from __future__ import annotations

from toygraph.errors import CudaError
from toygraph.ops.lowering import (FORMAT_KERNELS, MAX_GRID_YZ, Launch, declare_kernels, grid_1d,
                                   i32_arg, lowers, ptr_arg)
from toygraph.ops.lowering.constants import MM_BM, MM_THREADS

# The family's CUDA kernels, beside this module; the grouped GEMMs use matmul.cu's tile.
declare_kernels(__file__, "experts.cu", needs=("matmul.cu",))


#: The grouped GEMMs by direction, "nt" y = x @ W[e]^T, "nn" dx = dy @ W[e] (experts.cu):
#: over f32 expert weights, and over weights in their block format (patterns of
#: FORMAT_KERNELS, the kernels experts.cu defines once per format).
EXPERT_KERNELS = {"nt": "tg_expert_mm_nt", "nn": "tg_expert_mm_nn"}
EXPERT_BLOCK_KERNELS = {"nt": "tg_expert_mm_nt_<fmt>", "nn": "tg_expert_mm_nn_<fmt>"}


@lowers("topk", kernels=("tg_topk",))
def _topk(node, at):
    x = node.srcs[0]
    rows = node.size // node.attrs["k"]
    return [Launch("tg_topk", grid_1d(rows), [ptr_arg(at.out), ptr_arg(at.ptr(x)), i32_arg(rows),
                                               i32_arg(x.shape[-1]), i32_arg(node.attrs["k"])])]


def _along(node, at):
    """take_along (x [.., E] -> [.., k]) and its scatter put_along ([.., k] -> [.., E]):
    one thread per output element, E the wide side's last axis."""
    (name,) = at.kernels
    vals, ids = node.srcs
    E = node.shape[-1] if node.op == "put_along" else vals.shape[-1]
    return [Launch(name, grid_1d(node.size), [ptr_arg(at.out), ptr_arg(at.ptr(vals)),
                                              ptr_arg(at.ptr(ids)), i32_arg(node.size), i32_arg(E),
                                              i32_arg(ids.shape[-1])])]


lowers("take_along", kernels=("tg_take_along",))(_along)
lowers("put_along", kernels=("tg_put_along",))(_along)


@lowers("group_by_expert", kernels=("tg_group_by_expert",))
def _group(node, at):
    ids = node.srcs[0]
    E = node.attrs["n_expert"]
    return [Launch("tg_group_by_expert", (min(E, MAX_GRID_YZ), 1, 1),
                   [ptr_arg(at.out), ptr_arg(at.ptr(ids)), i32_arg(ids.size), i32_arg(E)])]


def _grid(what: str, n_cols: int, n_rows: int, n_expert: int) -> tuple[int, int, int]:
    """64x64 tiles over (columns, rows) per expert (grid z)."""
    gy = max(1, (n_rows + MM_BM - 1) // MM_BM)
    if gy > MAX_GRID_YZ or n_expert > MAX_GRID_YZ:
        raise CudaError(f"{what}: {n_rows} rows of {n_expert} experts exceed the kernel's grid")
    return (max(1, (n_cols + MM_BM - 1) // MM_BM), gy, n_expert)


def _weight_in_blocks(node, index: int) -> bool:
    """expert_matmul reads its expert weights (source 1) in their block format."""
    return index == 1


@lowers("expert_matmul", kernels=("tg_expert_mm_nt", "tg_expert_mm_nn"),
        block_format=_weight_in_blocks)
def _expert_matmul(node, at):
    """f32 weights: tg_expert_mm_nt/nn; block-format weights: tg_expert_mm_nt/nn_<fmt>."""
    x, w, routes = node.srcs
    E, rows, cols = w.shape
    N, k, n_out = node.shape
    kind = "nt" if node.attrs["trans_b"] else "nn"
    if w.id in at.raw_consts:
        from toygraph.gguf import blocks
        row = blocks.nbytes(w.storage, (1, cols))
        kernel = FORMAT_KERNELS[EXPERT_BLOCK_KERNELS[kind]][w.storage]
    else:
        row, kernel = cols, EXPERT_KERNELS[kind]
    grid = _grid(f"expert_matmul {node.name!r}", n_out, N * k, E)
    return [Launch(kernel, grid, [ptr_arg(at.out), ptr_arg(at.ptr(x)), ptr_arg(at.ptr(w)),
                                  ptr_arg(at.ptr(routes)), i32_arg(n_out), i32_arg(x.shape[-1]),
                                  i32_arg(E), i32_arg(k), i32_arg(x.ndim == 2),
                                  i32_arg(rows * row), i32_arg(row)],
                   block=(MM_THREADS, 1, 1))]


@lowers("expert_matmul_dw", kernels=("tg_expert_mm_dw",))
def _expert_matmul_dw(node, at):
    """dW[e] = dy^T x (trans_b) or x^T dy, over expert e's slots."""
    g, x, routes = node.srcs
    E, M, N = node.shape
    k = g.shape[1]
    a, b = (g, x) if node.attrs["trans_b"] else (x, g)
    return [Launch("tg_expert_mm_dw", _grid(f"expert_matmul_dw {node.name!r}", N, M, E),
                   [ptr_arg(at.out), ptr_arg(at.ptr(a)), i32_arg(a.ndim == 2), ptr_arg(at.ptr(b)),
                    i32_arg(b.ndim == 2), ptr_arg(at.ptr(routes)), i32_arg(M), i32_arg(N),
                    i32_arg(E), i32_arg(k)],
                   block=(MM_THREADS, 1, 1))]
