"""The row-wise normalisations over the last axis: rms_norm (x / sqrt(mean(x^2) + eps), optionally
times a weight in the same kernel) and softmax (scaled, optionally causal-masked), with their
backward ops, numpy kernels and CUDA lowering (norm.cu: one block per row, fixed-order tree
reductions). inv_row_norm (1 / ||row||, detached) serves DoRA.
The attention of the models is the fused op of flash_attention.py; softmax serves graphs that want the
probabilities."""
from __future__ import annotations

from toygraph.ops.elementwise import infer_same2
from toygraph.ops.shape import sum_to
from toygraph.ops.table import F32, check, check_floats, define_op, make_node


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
