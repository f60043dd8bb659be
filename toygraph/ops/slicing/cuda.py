"""The CUDA lowering of the slicing family (kernels in slicing.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import Launch, declare_kernels, grid_1d, i32_arg, lowers, ptr_arg

declare_kernels(__file__, "slicing.cu")


@lowers("narrow", "narrow_back", kernels=("tg_narrow", "tg_narrow_back"))
def _narrow(node, at):
    """One thread per output element; the backward writes zeros outside the slice."""
    (src,) = node.srcs
    if node.op == "narrow":
        width, length, start = src.shape[-1], node.shape[-1], node.attrs["start"]
    else:
        width, length, start = node.shape[-1], src.shape[-1], node.attrs["start"]
    return [Launch(node.op.replace("narrow", "tg_narrow"), grid_1d(node.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(src)), i32_arg(node.size), i32_arg(width),
                    i32_arg(length), i32_arg(start)])]
