"""The row-wise normalisations over the last axis: rms_norm (x / sqrt(mean(x^2) + eps), optionally
times a weight in the same kernel) and softmax (scaled, optionally causal-masked), with their
backward ops, numpy kernels and CUDA lowering (norm.cu: one block per row, fixed-order tree
reductions). inv_row_norm (1 / ||row||, detached) serves DoRA.
The attention of the models is the fused op of flash_attention.py; softmax serves graphs that want the
probabilities."""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.elementwise import infer_same2
from toygraph.core.ops.shape import sum_to
from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f32_arg, i32_arg, last_axis_rows,
                                    lowers, ptr_arg, rows_grid)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "norm.cu")


def rms_norm(x, eps: float, weight=None):
    """x / sqrt(mean(x^2, last axis) + eps), times ``weight`` when one is given: a [D] weight
    (the models' norm weights, one per column) or one of x's shape. The weighted norm is one
    kernel, rounded as the norm then a mul would round it: (x r) first, then (x r) w."""
    return make_node("rms_norm", [x] if weight is None else [x, weight], eps=float(eps))


def rms_norm_back(x, g, eps: float, weight=None):
    """The gradient of rms_norm(x, eps, weight) with respect to x, given g, the gradient of
    its output: the backward of the unweighted norm applied to g w (rounded first, as the
    mul's backward rounds it)."""
    srcs = [x, g] if weight is None else [x, g, weight]
    return make_node("rms_norm_back", srcs, eps=float(eps), weighted=weight is not None)


def _grad_rms(n, g, need):
    """dx through rms_norm_back; a weight's gradient sums g (x r) over the rows, (x r) being
    recomputed by an rms_norm weighted by g (the forward keeps only (x r) w), so it is the
    very product g * (x r) of the unfused mul's backward."""
    x, eps = n.srcs[0], n.attrs["eps"]
    w = n.srcs[1] if len(n.srcs) == 2 else None
    dx = rms_norm_back(x, g, eps, weight=w) if need[0] else None
    if w is None:
        return [dx]
    return [dx, sum_to(rms_norm(x, eps, weight=g), w.shape) if need[1] else None]


def _check_weight(x, w):
    check(len(x) >= 1 and tuple(w) in (tuple(x[-1:]), tuple(x)),
          f"the weight must be {list(x[-1:])} or x's shape {tuple(x)}, got {tuple(w)}")


def _infer_rms(shapes, dtypes, attrs):
    check_floats(dtypes)
    if len(shapes) == 2:
        _check_weight(shapes[0], shapes[1])
    return tuple(shapes[0]), F32


def _fold_add_rms_back(node, other):
    """rms_norm_back(x, g[, w]) + other in one kernel (the residual stream's gradient added
    where the norm's backward writes its rows); None when it already adds one."""
    if len(node.srcs) != 2 + node.attrs["weighted"]:
        return None
    return make_node("rms_norm_back", [*node.srcs, other], **node.attrs)


def _infer_rms_back(shapes, dtypes, attrs):
    base = 2 + attrs["weighted"]
    check(len(shapes) in (base, base + 1),
          "rms_norm_back takes x, g, the weight if weighted, and optionally a tensor to add")
    check_floats(dtypes)
    like_x = [shapes[1]] + list(shapes[base:])     # g and the tensor it adds
    check(all(tuple(s) == tuple(shapes[0]) for s in like_x), f"shapes must match, got {shapes}")
    if attrs["weighted"]:
        _check_weight(shapes[0], shapes[2])
    return tuple(shapes[0]), F32


define_op("rms_norm", _infer_rms, _grad_rms)
define_op("rms_norm_back", _infer_rms_back, fold_add=_fold_add_rms_back)


def softmax(x, *, scale: float = 1.0, causal: bool = False):
    """softmax(scale * x) over the last axis; ``causal`` masks key j > query i on the last
    two axes [queries, keys]."""
    return make_node("softmax", [x], scale=float(scale), causal=bool(causal))


def _infer_softmax(shapes, dtypes, attrs):
    check_floats(dtypes)
    if attrs["causal"]:
        s = shapes[0]
        check(len(s) >= 2 and s[-1] == s[-2], f"causal softmax needs [.., T, T], got {s}")
    return shapes[0], F32


define_op("softmax", _infer_softmax,
    lambda n, g, need: [make_node("softmax_back", [n, g], scale=n.attrs["scale"])])
define_op("softmax_back", infer_same2)


def inv_row_norm(x):
    """1 / sqrt(sum(x^2, last axis)): [..., D] -> [...]. Detached: no gradient flows
    through it (its backward rule gives none), as DoRA treats ||W + s B A|| as a constant
    (the DoRA paper, section 4.3; PEFT's ``weight_norm.detach()``)."""
    return make_node("inv_row_norm", [x])


def _infer_inv_row_norm(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(len(shapes[0]) >= 1, "inv_row_norm needs at least one axis")
    return shapes[0][:-1], F32


define_op("inv_row_norm", _infer_inv_row_norm, lambda n, g, need: [None])


# --- numpy kernels -----------------------------------------------------------------------------
def _rms_inv(x, eps):
    # np.mean's own two calls (its sum, then a true_divide by the count as an intp) without
    # its Python wrapper: the same bits, ~10 us less a call (61 calls a generated token)
    ms = np.add.reduce(x * x, axis=-1, keepdims=True)
    np.true_divide(ms, np.intp(x.shape[-1]), out=ms, casting="unsafe")
    return 1.0 / np.sqrt(ms + eps)


@kernel("rms_norm")
def _rms_norm_numpy(out, srcs, attrs):
    np.multiply(srcs[0], _rms_inv(srcs[0], attrs["eps"]), out=out)
    if len(srcs) == 2:   # (x r) w: the product of the rounded x r, as a mul after it
        np.multiply(out, srcs[1], out=out)


@kernel("rms_norm_back")
def _rms_norm_back_numpy(out, srcs, attrs):
    """r (g - y mean(g y)), y = x r, g times the weight first when weighted; plus the last
    source when there is one to add (as the add op adds: one rounding, and the sum's order
    does not change it)."""
    x, g = srcs[:2]
    base = 2 + attrs["weighted"]
    if attrs["weighted"]:
        g = g * srcs[2]
    r = _rms_inv(x, attrs["eps"])
    y = x * r
    out[...] = r * (g - y * np.mean(g * y, axis=-1, keepdims=True))
    if len(srcs) > base:
        np.add(out, srcs[base], out=out)


def _causal_mask(t):
    return np.triu(np.ones((t, t), bool), k=1)


@kernel("softmax")
def _softmax_numpy(out, srcs, attrs):
    z = srcs[0] * out.dtype.type(attrs["scale"])
    if attrs["causal"]:
        z[..., _causal_mask(z.shape[-1])] = -np.inf
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    np.divide(z, z.sum(axis=-1, keepdims=True), out=out)


@kernel("softmax_back")
def _softmax_back_numpy(out, srcs, attrs):
    y, g = srcs
    out[...] = attrs["scale"] * y * (g - np.sum(g * y, axis=-1, keepdims=True))


@kernel("inv_row_norm")
def _inv_row_norm_numpy(out, srcs, attrs):
    x = srcs[0]
    out[...] = 1.0 / np.sqrt(np.sum(x * x, axis=-1))


# --- CUDA lowering (norm.cu) -------------------------------------------------------------------
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
