"""The CUDA lowering of the rotary family (kernels in rotary.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import (Launch, declare_kernels, f64_arg, grid_1d, i32_arg, lowers,
                                   ptr_arg)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "rotary.cu")


@lowers("rope", kernels=("tg_rope",), bf16_reads=(0,), bf16_writes=True)
def _rope(node, at):
    """A null factors pointer: no frequency factors. x and the output may be kept in bf16
    (the bf16 mask's bits 0 and 16)."""
    s, a = node.srcs, node.attrs
    B, S, H, D = s[0].shape
    factors = at.ptr(s[2]) if len(s) == 3 else 0
    return [Launch("tg_rope", grid_1d(node.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(s[0])), ptr_arg(at.ptr(s[1])),
                    ptr_arg(factors), i32_arg(node.size), i32_arg(H), i32_arg(D),
                    i32_arg(a["dims"]), f64_arg(a["base"]), f64_arg(a["freq_scale"]),
                    i32_arg(a["mode"] == "neox"), i32_arg(a["inverse"]),
                    i32_arg(at.bf16_mask(node, s[:1]))])]
