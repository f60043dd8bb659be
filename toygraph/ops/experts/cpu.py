"""The experts family's engine replay (cpu.h beside this): topk, take_along, put_along,
group_by_expert, and expert_matmul (weights in f32, or a BlockTensor the engine multiplies
on its blocks) with its weight gradient expert_matmul_dw. Operands are C-contiguous, f32
values and i32 ids; anything else keeps the numpy kernel."""
from __future__ import annotations

import numpy as np

from toygraph.cpu import engine
from toygraph.cpu.block_tensor import BlockTensor
from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.gguf import blocks


def _i32_contiguous(*arrays) -> bool:
    return all(isinstance(a, np.ndarray) and a.dtype == np.int32 and a.flags.c_contiguous
               for a in arrays)


def _rows(a) -> int:
    """Rows of an array's last axis (its leading axes flattened)."""
    return a.size // a.shape[-1] if a.ndim and a.shape[-1] else 0


@replays("topk")
def _topk(node, out, srcs, attrs):
    x, k = srcs[0], attrs["k"]
    if (f32_contiguous(x) and _i32_contiguous(out) and x.ndim >= 1
            and out.shape == x.shape[:-1] + (k,) and 1 <= k <= x.shape[-1]):
        return Call("topk", [out, x], [_rows(x), x.shape[-1], k])


@replays("take_along")
def _take_along(node, out, srcs, attrs):
    x, ids = srcs
    if (f32_contiguous(out, x) and _i32_contiguous(ids) and x.ndim == ids.ndim >= 1
            and x.shape[:-1] == ids.shape[:-1] and out.shape == ids.shape and x.shape[-1]):
        return Call("take_along", [out, x, ids], [_rows(ids), x.shape[-1], ids.shape[-1]])


@replays("put_along")
def _put_along(node, out, srcs, attrs):
    g, ids = srcs
    width = attrs["width"]
    if (f32_contiguous(out, g) and _i32_contiguous(ids) and ids.ndim >= 1 and width >= 1
            and g.size == ids.size and out.shape == ids.shape[:-1] + (width,)):
        return Call("put_along", [out, g, ids], [_rows(ids), width, ids.shape[-1]])


@replays("group_by_expert")
def _group_by_expert(node, out, srcs, attrs):
    ids, E = srcs[0], attrs["n_expert"]
    if _i32_contiguous(out, ids) and ids.ndim == 2 and out.shape == (E + 1 + ids.size,):
        return Call("group_by_expert", [out, ids], [ids.size, E])


def _product(out, x, w_shape, routes, trans_b):
    """expert_matmul's integers (N, k, n_in, n_out, E, trans_b, per_slot) when the
    operands have the shapes the kernels take, else None."""
    if len(w_shape) != 3 or out.ndim != 3 or x.ndim not in (2, 3):
        return None
    E = w_shape[0]
    n_in, n_out = (w_shape[2], w_shape[1]) if trans_b else (w_shape[1], w_shape[2])
    N, k = out.shape[:2]
    if (out.shape[2] != n_out or x.shape[0] != N or x.shape[-1] != n_in
            or (x.ndim == 3 and x.shape[1] != k) or routes.shape != (E + 1 + N * k,)):
        return None
    return [N, k, n_in, n_out, E, bool(trans_b), x.ndim == 3]


def _on_blocks(out, x, w: BlockTensor, routes, ints):
    """The products on the experts' blocks: each expert a whole number of rows of bytes."""
    if not engine.available(w.storage):
        return None
    E, rows, length = w.shape
    row_bytes = blocks.nbytes(w.storage, (1, length))
    if row_bytes * rows * E != w.nbytes:
        return None
    w.read_sparsely()   # once per tensor: a page fault reads its page, not its neighbours'
    return Call("expert_matmul_blocks", [out, x, w.data, routes],
                ints + [engine.FORMATS.index(w.storage), row_bytes, row_bytes * rows])


@replays("expert_matmul")
def _expert_matmul(node, out, srcs, attrs):
    x, w, routes = srcs
    if not (f32_contiguous(out, x) and _i32_contiguous(routes)):
        return None
    ints = _product(out, x, w.shape, routes, attrs["trans_b"])
    if ints is None:
        return None
    if isinstance(w, BlockTensor):
        return _on_blocks(out, x, w, routes, ints)
    if f32_contiguous(w):
        return Call("expert_matmul", [out, x, w, routes], ints)


@replays("expert_matmul_dw")
def _expert_matmul_dw(node, out, srcs, attrs):
    g, x, routes = srcs
    if not (f32_contiguous(out, g, x) and _i32_contiguous(routes)):
        return None
    ints = _product(g, x, out.shape, routes, attrs["trans_b"])
    if ints is not None and tuple(out.shape) == tuple(attrs["w_shape"]):
        return Call("expert_matmul_dw", [out, g, x, routes], ints)
