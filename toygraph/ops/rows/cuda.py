"""The CUDA lowering of the rows family (kernels in rows.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.gemm.cuda import row_bytes
from toygraph.ops.lowering import (FORMAT_KERNELS, Launch, declare_kernels, f32_arg, grid_1d,
                                   i32_arg, lowers, ptr_arg, rows_grid)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "rows.cu")


def _table_in_blocks(node, index) -> bool:
    """get_rows reads its table (source 0) in its block format."""
    return index == 0


@lowers("get_rows", kernels=("tg_get_rows",), block_format=_table_in_blocks)
def _get_rows(node, at):
    """Dense table: tg_get_rows; block-format table: tg_get_rows_<fmt>."""
    table, ids = node.srcs
    n, D = node.size, table.shape[1]
    args = [ptr_arg(at.out), ptr_arg(at.ptr(table)), ptr_arg(at.ptr(ids)), i32_arg(n), i32_arg(D)]
    if table.id in at.raw_consts:
        return [Launch(FORMAT_KERNELS["tg_get_rows_<fmt>"][table.storage], grid_1d(n),
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
