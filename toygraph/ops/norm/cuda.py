"""The CUDA lowering of the norm family (kernels in norm.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import (Launch, declare_kernels, f32_arg, i32_arg, last_axis_rows,
                                   lowers, ptr_arg, rows_grid)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "norm.cu")


def _weight(w, D: int, at):
    """Weight ``w``'s pointer and row stride (0: a [D] weight every row reads; D: one of x's
    shape); a null pointer for none."""
    if w is None:
        return [ptr_arg(0), i32_arg(0)]
    return [ptr_arg(at.ptr(w)), i32_arg(0 if w.size == D else D)]


@lowers("rms_norm", kernels=("tg_rms_norm",), bf16_reads=(0, 1), bf16_writes=True)
def _rms_norm(node, at):
    """A block per row. x, the weight and the output may be kept in bf16 (the bf16 mask's
    bits 0, 1 and 16; the arithmetic is f32): at --precision bf16 the normalized rows only
    products read are (the pre-norms' output, the q/k norms' output, which rope reads), and
    so is a q/k norm's input, a projection's output. The residual stream it normalizes stays
    f32 (its maker, an add, writes f32), and a weight is a const or param, f32, except for
    the g a weight's gradient reads here (g (x r)), which may be bf16 as rms_norm_back's."""
    rows, D = last_axis_rows(node)
    w = node.srcs[1] if len(node.srcs) == 2 else None
    return [Launch("tg_rms_norm", rows_grid(rows),
                   [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])), *_weight(w, D, at),
                    i32_arg(rows), i32_arg(D), f32_arg(node.attrs["eps"]),
                    i32_arg(at.bf16_mask(node))])]


@lowers("rms_norm_back", kernels=("tg_rms_norm_back",), bf16_reads=(0, 1))
def _rms_norm_back(node, at):
    """A block per row: x and g, each possibly kept in bf16 (bits 0 and 1 of the bf16
    mask: g is a gradient made by products, x a q/k norm's projection output), the weight
    when weighted, then the tensor it adds (0: none). The weight, the added gradient and
    the output stay f32: the output is the residual stream's gradient, a sum."""
    rows, D = last_axis_rows(node)
    base = 2 + node.attrs["weighted"]
    w = node.srcs[2] if node.attrs["weighted"] else None
    add = at.ptr(node.srcs[base]) if len(node.srcs) > base else 0
    return [Launch("tg_rms_norm_back", rows_grid(rows),
                   [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])), ptr_arg(at.ptr(node.srcs[1])),
                    *_weight(w, D, at), ptr_arg(add), i32_arg(rows), i32_arg(D),
                    f32_arg(node.attrs["eps"]), i32_arg(at.bf16_mask(node, node.srcs[:2]))])]


@lowers("softmax", kernels=("tg_softmax",))
def _softmax(node, at):
    rows, T = last_axis_rows(node)
    return [Launch("tg_softmax", rows_grid(rows),
                   [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])), i32_arg(rows), i32_arg(T),
                    f32_arg(node.attrs["scale"]), i32_arg(node.attrs["causal"])])]


@lowers("softmax_back", kernels=("tg_softmax_back",))
def _softmax_back(node, at):
    rows, T = last_axis_rows(node)
    y, g = node.srcs
    return [Launch("tg_softmax_back", rows_grid(rows),
                   [ptr_arg(at.out), ptr_arg(at.ptr(y)), ptr_arg(at.ptr(g)), i32_arg(rows),
                    i32_arg(T), f32_arg(node.attrs["scale"])])]


@lowers("inv_row_norm", kernels=("tg_inv_row_norm",))
def _inv_row_norm(node, at):
    x = node.srcs[0]
    rows, D = x.size // x.shape[-1], x.shape[-1]
    return [Launch("tg_inv_row_norm", rows_grid(rows), [ptr_arg(at.out), ptr_arg(at.ptr(x)),
                                                        i32_arg(rows), i32_arg(D)])]
