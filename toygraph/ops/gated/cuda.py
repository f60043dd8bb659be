"""The CUDA lowering of the gated family (kernels in elementwise.cu, gated.cu; its ops and their
rules are in __init__.py)."""
from __future__ import annotations

from toygraph.ops.gated import ACTS, up_offset
from toygraph.ops.lowering import Launch, declare_kernels, grid_1d, i32_arg, lowers, ptr_arg

declare_kernels(__file__, "gated.cu", needs=("elementwise.cu",))


@lowers("glu", "glu_back", kernels=("tg_glu", "tg_glu_back"), bf16_reads=(0, 1, 2),
        bf16_writes=True)
def _glu(node, at):
    act, mask = i32_arg(ACTS[node.attrs["act"]][0]), i32_arg(at.bf16_mask(node))
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    if node.op == "glu":
        return [Launch("tg_glu", grid_1d(node.size),
                       [ptr_arg(at.out), *srcs, i32_arg(node.size), act, mask])]
    n = node.srcs[0].size
    return [Launch("tg_glu_back", grid_1d(n),
                   [ptr_arg(at.out), *srcs, i32_arg(n), i32_arg(up_offset(n)), act, mask])]
