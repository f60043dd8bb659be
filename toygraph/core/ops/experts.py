"""Mixture-of-experts ops: the router's top-k choice, the token-by-expert grouping, and
the per-expert matmul that computes only the chosen experts. Builders, shape rules,
backward rules, numpy kernels and CUDA lowering (experts.cu).

One MoE FFN over N tokens with E experts, k of them per token (models/moe.py)::

    logits = x @ W_router^T                       [N, E]
    ids    = topk(logits or softmax(logits), k)   [N, k] i32: not differentiated
    w      = softmax(take_along(logits, ids))     [N, k] (or take_along(softmax(logits), ids))
    routes = group_by_expert(ids, E)              i32: the slots sorted by expert, stably
    h      = expert_matmul(x, W_gate_exps, routes)    [N, k, F]: one GEMM per expert
    ...
    out    = sum_j w[:, j] * expert_matmul(a, W_down_exps, routes)[:, j]

The gradient reaches the router through ``w`` (take_along's backward scatters into the
chosen logits); the choice itself, like in transformers and llama.cpp, has none.

``routes`` ([E + 1 + N*k] i32) holds the expert offsets (expert e's slots are
``perm[off[e]:off[e + 1]]``) then ``perm``, the flat slot ids n*k + j ordered by expert and,
within an expert, by slot: a deterministic order, so every backend sums the same rows in
the same order.
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.gemm import DEQUANT_KERNELS
from toygraph.core.ops.shape import sum as _sum
from toygraph.core.ops.table import (F32, I32, block_kernel, check, check_floats, define_op,
                                     kernel, make_node)
from toygraph.cuda.lowering import (MAX_GRID_YZ, Launch, declare_kernels, grid_1d, i32_arg, lowers,
                                    ptr_arg)
from toygraph.cuda.lowering.constants import MM_BM, MM_THREADS
from toygraph.errors import CudaError

# The family's CUDA kernels, beside this module; the grouped GEMMs use matmul.cu's tile.
declare_kernels(__file__, "experts.cu", needs=("matmul.cu",))

#: Grouped-GEMM kernels reading the expert weights in their block format, per format:
#: "nt" y = x @ W[e]^T, "nn" dx = dy @ W[e] (experts.cu).
EXPERT_KERNELS: dict[str, dict[str, str]] = {
    fmt: {"nt": f"tg_expert_mm_nt_{fmt}", "nn": f"tg_expert_mm_nn_{fmt}"}
    for fmt in DEQUANT_KERNELS
}

# --- builders and rules ------------------------------------------------------------------------


def topk(x, k: int):
    """Indices [..., k] (i32) of the k largest entries of x's last axis, largest first;
    ties go to the lower index. Not differentiable (an integer result)."""
    return make_node("topk", [x], k=int(k))


def _infer_topk(shapes, dtypes, attrs):
    check_floats(dtypes)
    k, s = attrs["k"], shapes[0]
    check(len(s) >= 1 and 1 <= k <= s[-1], f"topk needs 1 <= k <= {s[-1] if s else 0}, got {k}")
    return tuple(s[:-1]) + (k,), I32


def take_along(x, ids):
    """x[..., ids]: for each row of x [..., E], the entries at that row's ids [..., k]."""
    return make_node("take_along", [x, ids])


def _infer_take_along(shapes, dtypes, attrs):
    (xs, ids), (xd, idd) = shapes, dtypes
    check(xd == F32 and idd == I32, "take_along needs f32 values and i32 ids")
    check(len(xs) == len(ids) and tuple(xs[:-1]) == tuple(ids[:-1]),
          f"ids {ids} must match x {xs} on every axis but the last")
    return tuple(ids), F32


def _infer_put_along(shapes, dtypes, attrs):
    return tuple(shapes[1][:-1]) + (attrs["width"],), F32


def group_by_expert(ids, n_expert: int):
    """The slots of ``ids`` [N, k] grouped by expert: [n_expert + 1 + N*k] i32, the
    offsets of each expert's group then the flat slot ids in that order (stable)."""
    return make_node("group_by_expert", [ids], n_expert=int(n_expert))


def _infer_group(shapes, dtypes, attrs):
    check(dtypes[0] == I32 and len(shapes[0]) == 2, f"ids must be [N, k] i32, got {shapes[0]}")
    check(attrs["n_expert"] >= 1, "n_expert must be >= 1")
    n, k = shapes[0]
    return (attrs["n_expert"] + 1 + n * k,), I32


def expert_matmul(x, w, routes, *, trans_b: bool = True):
    """Per slot (n, j) of ``routes``: x[n] (or x[n, j]) @ W[e]^T, e the slot's expert.

    ``x`` [N, n_in] (every slot of token n reads row n) or [N, k, n_in]; ``w``
    [E, n_out, n_in] (``trans_b=False``: [E, n_in, n_out], y = x @ W[e]). The result is
    [N, k, n_out]; each expert's rows are one GEMM, and experts no token chose are never
    read."""
    return make_node("expert_matmul", [x, w, routes], trans_b=bool(trans_b))


def _slots(routes_shape, n_expert: int) -> int:
    return routes_shape[0] - n_expert - 1


def _infer_expert_matmul(shapes, dtypes, attrs):
    (xs, ws, rs), (xd, wd, rd) = shapes, dtypes
    check(xd == F32 and wd == F32 and rd == I32, "expert_matmul needs f32 x and w, i32 routes")
    check(len(ws) == 3, f"w must be [experts, n_out, n_in], got {ws}")
    E = ws[0]
    n_in, n_out = (ws[2], ws[1]) if attrs["trans_b"] else (ws[1], ws[2])
    check(len(xs) in (2, 3) and xs[-1] == n_in, f"x must be [N, {n_in}] or [N, k, {n_in}], got {xs}")
    R = _slots(rs, E)
    check(len(rs) == 1 and R >= xs[0] and R % xs[0] == 0,
          f"routes {rs} do not hold {E} experts' groups of slots of {xs[0]} tokens")
    k = R // xs[0]
    check(len(xs) == 2 or xs[1] == k, f"x {xs} must have {k} slots per token")
    return (xs[0], k, n_out), F32


def _infer_expert_matmul_dw(shapes, dtypes, attrs):
    check_floats(dtypes[:2])
    return tuple(attrs["w_shape"]), F32


def _grad_expert_matmul(n, g, need):
    x, w, routes = n.srcs
    tb = n.attrs["trans_b"]
    gx = gw = None
    if need[0]:  # dx = dy @ W[e] (or W[e]^T); a 2-D x sums its k slots
        gx = expert_matmul(g, w, routes, trans_b=not tb)
        if x.ndim == 2:
            gx = _sum(gx, 1)
    if need[1]:
        gw = make_node("expert_matmul_dw", [g, x, routes], trans_b=tb, w_shape=w.shape)
    return [gx, gw, None]


define_op("topk", _infer_topk)
define_op("take_along", _infer_take_along, lambda n, g, need: [
    make_node("put_along", [g, n.srcs[1]], width=n.srcs[0].shape[-1]), None],
    id_ranges=lambda n: {1: (0, n.srcs[0].shape[-1], f"the last axis of {n.srcs[0].name}")})
define_op("put_along", _infer_put_along)
define_op("group_by_expert", _infer_group,
          id_ranges=lambda n: {0: (0, n.attrs["n_expert"], "the experts")})
define_op("expert_matmul", _infer_expert_matmul, _grad_expert_matmul)
define_op("expert_matmul_dw", _infer_expert_matmul_dw)


# --- numpy kernels -----------------------------------------------------------------------------
@kernel("topk")
def _topk_numpy(out, srcs, attrs):
    # A stable sort of -x: largest first, equal values in index order.
    out[...] = np.argsort(-srcs[0], axis=-1, kind="stable")[..., :attrs["k"]]


@kernel("take_along")
def _take_along_numpy(out, srcs, attrs):
    out[...] = np.take_along_axis(srcs[0], srcs[1].astype(np.intp), axis=-1)


@kernel("put_along")
def _put_along_numpy(out, srcs, attrs):
    g, ids = srcs
    out.fill(0)
    rows = out.reshape(-1, out.shape[-1])
    idx = ids.reshape(-1, ids.shape[-1])
    np.add.at(rows, (np.arange(len(idx))[:, None], idx), g.reshape(idx.shape))


def split_routes(routes, n_expert: int):
    """(offsets [E + 1], perm [N*k]) of a group_by_expert result."""
    return routes[:n_expert + 1], routes[n_expert + 1:]


@kernel("group_by_expert")
def _group_numpy(out, srcs, attrs):
    flat = srcs[0].reshape(-1)
    E = attrs["n_expert"]
    out[0] = 0
    np.cumsum(np.bincount(flat, minlength=E), out=out[1:E + 1])
    out[E + 1:] = np.argsort(flat, kind="stable")


def _groups(routes, n_expert: int):
    """(expert, its slot ids) for every expert some slot chose."""
    off, perm = split_routes(routes, n_expert)
    for e in range(n_expert):
        if off[e + 1] > off[e]:
            yield e, perm[off[e]:off[e + 1]]


@kernel("expert_matmul")
def _expert_matmul_numpy(out, srcs, attrs):
    x, w, routes = srcs
    N, k, n_out = out.shape
    rows = out.reshape(N * k, n_out)
    xr = x.reshape(-1, x.shape[-1])
    for e, slots in _groups(routes, w.shape[0]):
        src = slots // k if x.ndim == 2 else slots
        we = w[e].T if attrs["trans_b"] else w[e]
        rows[slots] = xr[src] @ we


def _one_expert(w_shape) -> int:
    """Elements of one expert of expert_matmul's weights [E, ., .]."""
    return int(np.prod(w_shape[1:]))


@block_kernel("expert_matmul", reads=(1,), scratch=lambda node: _one_expert(node.srcs[1].shape))
def _expert_matmul_blocks(out, srcs, attrs, scratch):
    """Weights kept in their block format (a cpu.block_tensor.BlockTensor): each expert some
    slot chose is decoded, alone, into the scratch just before its GEMM, so the experts no
    token chose are never read (their pages of the mapped file stay untouched). The same
    decoded values in the same layout reach the same GEMM as in _expert_matmul_numpy."""
    x, w, routes = srcs
    N, k, n_out = out.shape
    rows = out.reshape(N * k, n_out)
    xr = x.reshape(-1, x.shape[-1])
    we = scratch[:_one_expert(w.shape)].reshape(w.shape[1:])
    groups = list(_groups(routes, w.shape[0]))
    w.read_sparsely()     # no read-ahead into the unused experts around a chosen one
    for e, _ in groups:   # start reading every chosen expert's pages, and only theirs
        w.part(e).prefetch()
    for e, slots in groups:
        src = slots // k if x.ndim == 2 else slots
        w.part(e).decode_into(we)
        rows[slots] = xr[src] @ (we.T if attrs["trans_b"] else we)


@kernel("expert_matmul_dw")
def _expert_matmul_dw_numpy(out, srcs, attrs):
    g, x, routes = srcs
    N, k, _ = g.shape
    gr = g.reshape(N * k, -1)
    xr = x.reshape(-1, x.shape[-1])
    out.fill(0)
    for e, slots in _groups(routes, out.shape[0]):
        src = slots // k if x.ndim == 2 else slots
        # y = x W^T: dW = dy^T x;  y = x W: dW = x^T dy
        out[e] = gr[slots].T @ xr[src] if attrs["trans_b"] else xr[src].T @ gr[slots]


# --- CUDA lowering (experts.cu) ----------------------------------------------------------------
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
    """f32 weights: tg_expert_mm_nt/nn; block-format weights: EXPERT_KERNELS[fmt]."""
    x, w, routes = node.srcs
    E, rows, cols = w.shape
    N, k, n_out = node.shape
    kind = "nt" if node.attrs["trans_b"] else "nn"
    if w.id in at.raw_consts:
        from toygraph.gguf import blocks
        row = blocks.nbytes(w.storage, (1, cols))
        kernel = EXPERT_KERNELS[w.storage][kind]
    else:
        row, kernel = cols, f"tg_expert_mm_{kind}"
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
