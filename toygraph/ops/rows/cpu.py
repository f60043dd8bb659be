"""The rows family's engine replay (cpu.h beside this): get_rows from an f32 table or one
kept in its GGUF blocks (ids checked on upload: the session's id ranges), and
get_rows_back into an f32 table (its kernel checks the ids again: a row out of range fails
the replay instead of writing outside)."""
from __future__ import annotations

import numpy as np

from toygraph.cpu import engine
from toygraph.cpu.block_tensor import BlockTensor
from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.gguf import blocks


@replays("get_rows")
def _get_rows(node, out, srcs, attrs):
    table, ids = srcs
    if not (f32_contiguous(out) and ids.dtype == np.int32 and ids.flags.c_contiguous
            and len(table.shape) == 2):
        return None
    K = table.shape[1]
    if isinstance(table, BlockTensor):
        if not engine.available(table.storage):
            return None
        fmt, row_bytes, data = engine.FORMATS.index(table.storage), \
            blocks.nbytes(table.storage, (1, K)), table.data
    elif f32_contiguous(table):
        fmt, row_bytes, data = -1, 4 * K, table
    else:
        return None
    return Call("get_rows", [out, data, ids], [ids.size, K, fmt, row_bytes])


@replays("get_rows_back")
def _get_rows_back(node, out, srcs, attrs):
    g, ids = srcs
    if (f32_contiguous(out, g) and out.ndim == 2 and ids.dtype == np.int32
            and ids.flags.c_contiguous and g.shape == ids.shape + out.shape[1:]):
        return Call("get_rows_back", [out, g, ids], [ids.size, out.shape[1], out.shape[0]])
