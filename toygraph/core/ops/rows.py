"""get_rows: the embedding lookup table[ids] and its backward scatter-add. Builder, shape
rule, backward rule, numpy kernels and CUDA lowering (rows.cu; a table kept in its GGUF
block format is decoded row by row with blocks.cuh)."""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.gemm import QUANT_KERNELS, row_bytes
from toygraph.core.ops.table import F32, I32, block_kernel, check, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                    ptr_arg, rows_grid)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "rows.cu")


def get_rows(table, ids):
    """table[ids]: rows of a [rows, dim] table gathered by integer ids of any shape."""
    return make_node("get_rows", [table, ids])


def _infer_get_rows(shapes, dtypes, attrs):
    check(dtypes[0] == F32 and dtypes[1] == I32, "get_rows needs an f32 table and i32 ids")
    check(len(shapes[0]) == 2, f"table must be 2-D, got {shapes[0]}")
    return tuple(shapes[1]) + (shapes[0][1],), F32


def _infer_get_rows_back(shapes, dtypes, attrs):
    return (attrs["rows"], shapes[0][-1]), F32


define_op("get_rows", _infer_get_rows, lambda n, g, need: [
    make_node("get_rows_back", [g, n.srcs[1]], rows=n.srcs[0].shape[0]), None],
    id_ranges=lambda n: {1: (0, n.srcs[0].shape[0], f"rows of {n.srcs[0].name}")})
define_op("get_rows_back", _infer_get_rows_back)


# --- numpy kernels -----------------------------------------------------------------------------
@kernel("get_rows")
def _get_rows_numpy(out, srcs, attrs):
    table, ids = srcs
    np.take(table, ids, axis=0, out=out)


@block_kernel("get_rows", reads=(0,))
def _get_rows_blocks(out, srcs, attrs, scratch):
    """A table kept in its block format (a cpu.block_tensor.BlockTensor): only the gathered
    rows are decoded, straight into the output."""
    table, ids = srcs
    table.decode_rows(ids, out)


@kernel("get_rows_back")
def _get_rows_back_numpy(out, srcs, attrs):
    g, ids = srcs
    out.fill(0)
    np.add.at(out, ids.reshape(-1), g.reshape(-1, g.shape[-1]))


# --- CUDA lowering (rows.cu) -------------------------------------------------------------------
def _table_in_blocks(node, index) -> bool:
    """get_rows reads its table (source 0) in its block format."""
    return index == 0


@lowers("get_rows", kernels=("tg_get_rows",), block_format=_table_in_blocks)
def _get_rows(node, at):
    """Dense table: tg_get_rows; block-format table: QUANT_KERNELS[fmt]["rows"]."""
    table, ids = node.srcs
    n, D = node.size, table.shape[1]
    args = [ptr_arg(at.out), ptr_arg(at.ptr(table)), ptr_arg(at.ptr(ids)), i32_arg(n), i32_arg(D)]
    if table.id in at.raw_consts:
        return [Launch(QUANT_KERNELS[table.storage]["rows"], grid_1d(n),
                       [*args, i32_arg(row_bytes(table))])]
    return [Launch("tg_get_rows", grid_1d(n), args)]


@lowers("get_rows_back", kernels=("tg_fill", "tg_get_rows_back"))
def _get_rows_back(node, at):
    g, ids = node.srcs
    n, N, D = node.size, ids.size, node.shape[1]
    return [Launch("tg_fill", grid_1d(n), [ptr_arg(at.out), i32_arg(n), f32_arg(0.0)]),
            Launch("tg_get_rows_back", rows_grid(N),
                   [ptr_arg(at.out), ptr_arg(at.ptr(g)), ptr_arg(at.ptr(ids)), i32_arg(N),
                    i32_arg(D)])]
