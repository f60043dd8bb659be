"""The numpy kernels of the rows family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import block_kernel, kernel


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
