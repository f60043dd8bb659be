"""CUDA lowering of the row-wise ops (rows.cu, elementwise.cu's rope and row gathers):
rms_norm, rope, softmax, get_rows and their backward ops."""
from __future__ import annotations

from .kernels import QUANT_KERNELS
from .launch import Launch, _blocks, _rows_grid, f32, f64, i32, p
from .lower_matmul import row_bytes
from .registry import lowers


def _rows(node):
    """(rows, row length) of a row-wise op over the last axis."""
    D = node.shape[-1] if node.shape else 1
    return node.size // D, D


def _rms(kernel, node, at):
    rows, D = _rows(node)
    srcs = [p(at.ptr(t)) for t in node.srcs]
    return [Launch(kernel, _rows_grid(rows),
                   [p(at.out), *srcs, i32(rows), i32(D), f32(node.attrs["eps"])])]


@lowers("rms_norm", kernels=("tg_rms_norm",))
def _rms_norm(node, at):
    return _rms("tg_rms_norm", node, at)


@lowers("rms_norm_back", kernels=("tg_rms_norm_back",))
def _rms_norm_back(node, at):
    return _rms("tg_rms_norm_back", node, at)


@lowers("rope", kernels=("tg_rope",))
def _rope(node, at):
    """A null factors pointer: no frequency factors."""
    s, a = node.srcs, node.attrs
    B, S, H, D = s[0].shape
    factors = at.ptr(s[2]) if len(s) == 3 else 0
    return [Launch("tg_rope", _blocks(node.size),
                   [p(at.out), p(at.ptr(s[0])), p(at.ptr(s[1])), p(factors), i32(node.size),
                    i32(H), i32(D), i32(a["dims"]), f64(a["base"]), f64(a["freq_scale"]),
                    i32(a["mode"] == "neox"), i32(a["inverse"])])]


@lowers("softmax", kernels=("tg_softmax",))
def _softmax(node, at):
    rows, T = _rows(node)
    return [Launch("tg_softmax", _rows_grid(rows),
                   [p(at.out), p(at.ptr(node.srcs[0])), i32(rows), i32(T),
                    f32(node.attrs["scale"]), i32(node.attrs["causal"])])]


@lowers("softmax_back", kernels=("tg_softmax_back",))
def _softmax_back(node, at):
    rows, T = _rows(node)
    y, g = node.srcs
    return [Launch("tg_softmax_back", _rows_grid(rows),
                   [p(at.out), p(at.ptr(y)), p(at.ptr(g)), i32(rows), i32(T),
                    f32(node.attrs["scale"])])]


def _table_in_blocks(node, index) -> bool:
    """get_rows reads its table (source 0) in its block format."""
    return index == 0


@lowers("get_rows", kernels=("tg_get_rows",), block_format=_table_in_blocks)
def _get_rows(node, at):
    """Dense table: tg_get_rows; block-format table: QUANT_KERNELS[fmt]["rows"]."""
    table, ids = node.srcs
    n, D = node.size, table.shape[1]
    args = [p(at.out), p(at.ptr(table)), p(at.ptr(ids)), i32(n), i32(D)]
    if table.id in at.raw_consts:
        return [Launch(QUANT_KERNELS[table.storage]["rows"], _blocks(n),
                       [*args, i32(row_bytes(table))])]
    return [Launch("tg_get_rows", _blocks(n), args)]


@lowers("get_rows_back", kernels=("tg_fill", "tg_get_rows_back"))
def _get_rows_back(node, at):
    g, ids = node.srcs
    n, N, D = node.size, ids.size, node.shape[1]
    return [Launch("tg_fill", _blocks(n), [p(at.out), i32(n), f32(0.0)]),
            Launch("tg_get_rows_back", _rows_grid(N),
                   [p(at.out), p(at.ptr(g)), p(at.ptr(ids)), i32(N), i32(D)])]
