"""get_rows: the embedding lookup table[ids] and its backward scatter-add. Builder, shape
rule, backward rule, numpy kernels and CUDA lowering (rows.cu; a table kept in its GGUF
block format is decoded row by row with blocks.cuh)."""
from __future__ import annotations

from toygraph.ops.table import F32, I32, check, define_op, make_node


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
