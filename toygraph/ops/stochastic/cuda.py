"""The CUDA lowering of the stochastic family (kernels in stochastic.cu; its ops and their rules
are in __init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                   ptr_arg)
from toygraph.ops.stochastic import threshold

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "stochastic.cu")


def _signed(v: int) -> int:
    """A uint32 as the int32 with its bits (the kernel reads it back as unsigned)."""
    return v - (1 << 32) if v >= 1 << 31 else v


@lowers("dropout", kernels=("tg_dropout",))
def _dropout(node, at):
    x, hp = node.srcs
    a = node.attrs
    return [Launch("tg_dropout", grid_1d(x.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(x)), ptr_arg(at.ptr(hp)), i32_arg(x.size),
                    i32_arg(_signed(a["seed"])), i32_arg(_signed(a["salt"])),
                    i32_arg(threshold(a["p"])), f32_arg(np.float32(1.0 / (1.0 - a["p"])))])]
