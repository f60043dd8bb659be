"""The row-wise normalisations over the last axis: rms_norm (x / sqrt(mean(x^2) + eps)) and
softmax (scaled, optionally causal-masked), with their backward ops, numpy kernels and CUDA
lowering (norm.cu: one block per row, fixed-order tree reductions). inv_row_norm (1 / ||row||, detached) serves DoRA.
The attention of the models is the fused op of flash_attention.py; softmax serves graphs that want the
probabilities."""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.elementwise import infer_same2, infer_unary
from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f32, i32, last_axis_rows, lowers, p,
                                    rows_grid)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "norm.cu")


def rms_norm(x, eps: float):
    """x / sqrt(mean(x^2, last axis) + eps); multiply by a weight separately."""
    return make_node("rms_norm", [x], eps=float(eps))


def _fold_add_rms_back(node, other):
    """rms_norm_back(x, g) + other in one kernel (the residual stream's gradient added where
    the norm's backward writes its rows); None when it already adds one."""
    if len(node.srcs) != 2:
        return None
    return make_node("rms_norm_back", [*node.srcs, other], eps=node.attrs["eps"])


def _infer_rms_back(shapes, dtypes, attrs):
    check(len(shapes) in (2, 3), "rms_norm_back takes x, g and optionally a tensor to add")
    check_floats(dtypes)
    check(all(s == shapes[0] for s in shapes), f"shapes must match, got {shapes}")
    return tuple(shapes[0]), F32


define_op("rms_norm", infer_unary,
    lambda n, g, need: [make_node("rms_norm_back", [n.srcs[0], g], eps=n.attrs["eps"])])
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
@kernel("rms_norm")
def _rms_norm_numpy(out, srcs, attrs):
    x = srcs[0]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs["eps"])
    np.multiply(x, r, out=out)


@kernel("rms_norm_back")
def _rms_norm_back_numpy(out, srcs, attrs):
    """r (g - y mean(g y)), y = x r; plus the third source when there is one (added as
    the add op adds: one rounding, and the sum's order does not change it)."""
    x, g = srcs[:2]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs["eps"])
    y = x * r
    out[...] = r * (g - y * np.mean(g * y, axis=-1, keepdims=True))
    if len(srcs) == 3:
        np.add(out, srcs[2], out=out)


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
def _rms(node, at):
    """A block per row; rms_norm_back's g is one more pointer after x, then the tensor it
    adds (0: none)."""
    (name,) = at.kernels
    rows, D = last_axis_rows(node)
    srcs = [p(at.ptr(t)) for t in node.srcs[:2]]
    if node.op == "rms_norm_back":
        srcs.append(p(at.ptr(node.srcs[2]) if len(node.srcs) == 3 else 0))
    return [Launch(name, rows_grid(rows),
                   [p(at.out), *srcs, i32(rows), i32(D), f32(node.attrs["eps"])])]


lowers("rms_norm", kernels=("tg_rms_norm",))(_rms)
lowers("rms_norm_back", kernels=("tg_rms_norm_back",))(_rms)


@lowers("softmax", kernels=("tg_softmax",))
def _softmax(node, at):
    rows, T = last_axis_rows(node)
    return [Launch("tg_softmax", rows_grid(rows),
                   [p(at.out), p(at.ptr(node.srcs[0])), i32(rows), i32(T),
                    f32(node.attrs["scale"]), i32(node.attrs["causal"])])]


@lowers("softmax_back", kernels=("tg_softmax_back",))
def _softmax_back(node, at):
    rows, T = last_axis_rows(node)
    y, g = node.srcs
    return [Launch("tg_softmax_back", rows_grid(rows),
                   [p(at.out), p(at.ptr(y)), p(at.ptr(g)), i32(rows), i32(T),
                    f32(node.attrs["scale"])])]


@lowers("inv_row_norm", kernels=("tg_inv_row_norm",))
def _inv_row_norm(node, at):
    x = node.srcs[0]
    rows, D = x.size // x.shape[-1], x.shape[-1]
    return [Launch("tg_inv_row_norm", rows_grid(rows), [p(at.out), p(at.ptr(x)), i32(rows), i32(D)])]
