"""The rows family's engine replay (cpu.h beside this): get_rows from an f32 table or one
kept in its GGUF blocks (ids checked on upload: the session's id ranges)."""
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
