"""The optimizer's in-graph ops: accumulate (gradient accumulation), global_norm (the
gradient norm for clipping) and adamw (one update of every param). accumulate and adamw write their
sources in place and produce no value; none of them has a gradient. Builders, shape
rules, numpy kernels and CUDA lowering (update.cu). toygraph/core/optimizer.py builds the update
graph from them."""
from __future__ import annotations

from toygraph.errors import GraphError
from toygraph.ops.groups import IN_PLACE
from toygraph.ops.table import F32, NONE, check, check_floats, define_op, make_node


def accumulate(acc, value):
    """acc += value, in place (gradient accumulation across micro-batches)."""
    return make_node("accumulate", [acc, value])


def _infer_accumulate(shapes, dtypes, attrs):
    check(shapes[0] == shapes[1], f"accumulator {shapes[0]} and value {shapes[1]} differ")
    return (), NONE


def global_norm(grads, divisor):
    """sqrt(sum of squares of every grad) / divisor — the global gradient norm."""
    return make_node("global_norm", list(grads) + [divisor])


def _infer_global_norm(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(shapes[-1] == (), "the divisor must be a scalar")
    return (), F32


def adamw(params, grads, ms, vs, hp, norm, divisor, *, max_norm: float, lr_scales=None):
    """One AdamW update in place of every param and its moments m and v, from its
    accumulated grad: one node for all of them, so CUDA runs it in a few multi-tensor
    launches rather than one per param.

    The gradient used is grad / divisor, scaled by min(1, max_norm / norm) when max_norm > 0;
    ``hp`` is the row [lr, b1, b2, eps, wd, 1/(1-b1^t), 1/(1-b2^t), t, micro]. ``lr_scales``
    (one per param, default 1) multiplies that param's learning rate (LoRA+: B's rate is
    lr * ratio), a constant of the graph, so every replayed step (and a resumed run)
    applies the same one; the f32 product lr * 1.0 is lr exactly, so a scale of 1 changes
    no bit. Each param's update is the one-param update: the result does not depend on
    how params are grouped.
    """
    k = len(params)
    if not k or not len(grads) == len(ms) == len(vs) == k:
        raise GraphError(f"adamw needs one grad, m and v per param, got {k} params, "
                         f"{len(grads)} grads, {len(ms)} m and {len(vs)} v")
    scales = tuple(float(x) for x in (lr_scales if lr_scales is not None else [1.0] * k))
    if len(scales) != k:
        raise GraphError(f"adamw needs one lr scale per param, got {len(scales)} for {k}")
    return make_node("adamw", [*params, *grads, *ms, *vs, hp, norm, divisor],
                     max_norm=float(max_norm), lr_scales=scales)


def adamw_groups(srcs):
    """(w, g, m, v) per param of an adamw node's sources, then (hp, norm, divisor)."""
    k = (len(srcs) - 3) // 4
    return [tuple(srcs[j * k + i] for j in range(4)) for i in range(k)], srcs[-3:]


def _infer_adamw(shapes, dtypes, attrs):
    check_floats(dtypes)
    check((len(shapes) - 3) % 4 == 0, "adamw takes params, grads, m and v, then hp, norm, divisor")
    groups, (hp, norm, div) = adamw_groups(shapes)
    for w, g, m, v in groups:
        check(w == g == m == v, f"param, grad and moments must share a shape, got {w} {g} {m} {v}")
    check(len(attrs["lr_scales"]) == len(groups), "adamw needs one lr scale per param")
    check(hp == (9,), f"hp must be the 9-value row (core/optimizer.hp_row), got {hp}")
    check(norm == () and div == (), "norm and divisor must be scalars")
    return (), NONE


define_op("accumulate", _infer_accumulate, groups={IN_PLACE})
define_op("global_norm", _infer_global_norm)
define_op("adamw", _infer_adamw, groups={IN_PLACE})
