"""Mixture-of-experts ops: the router's top-k choice, the token-by-expert grouping, and
the per-expert matmul that computes only the chosen experts. Builders, shape rules,
backward rules, numpy kernels and CUDA lowering (experts.cu).

One MoE FFN over N tokens with E experts, k of them per token (models/moe.py)::

    logits = x @ W_router^T                       [N, E]
    ids    = topk(logits or softmax(logits), k)   [N, k] i32: not differentiated
    w      = softmax(take_along(logits, ids))     [N, k] (or take_along(softmax(logits), ids))
    routes = group_by_expert(ids, E)              i32: the slots sorted by expert, stably
    h      = expert_matmul(x, W_gate_exps, routes)    [N, k, F]: one GEMM per expert
    ...
    out    = sum_j w[:, j] * expert_matmul(a, W_down_exps, routes)[:, j]

The gradient reaches the router through ``w`` (take_along's backward scatters into the
chosen logits); the choice itself, like in transformers and llama.cpp, has none.

``routes`` ([E + 1 + N*k] i32) holds the expert offsets (expert e's slots are
``perm[off[e]:off[e + 1]]``) then ``perm``, the flat slot ids n*k + j ordered by expert and,
within an expert, by slot: a deterministic order, so every backend sums the same rows in
the same order.
"""
from __future__ import annotations

from toygraph.ops.shape import sum as _sum
from toygraph.ops.table import F32, I32, check, check_floats, define_op, make_node

# --- builders and rules ------------------------------------------------------------------------


def topk(x, k: int):
    """Indices [..., k] (i32) of the k largest entries of x's last axis, largest first;
    ties go to the lower index. Not differentiable (an integer result)."""
    return make_node("topk", [x], k=int(k))


def _infer_topk(shapes, dtypes, attrs):
    check_floats(dtypes)
    k, s = attrs["k"], shapes[0]
    check(len(s) >= 1 and 1 <= k <= s[-1], f"topk needs 1 <= k <= {s[-1] if s else 0}, got {k}")
    return tuple(s[:-1]) + (k,), I32


def take_along(x, ids):
    """x[..., ids]: for each row of x [..., E], the entries at that row's ids [..., k]."""
    return make_node("take_along", [x, ids])


def _infer_take_along(shapes, dtypes, attrs):
    (xs, ids), (xd, idd) = shapes, dtypes
    check(xd == F32 and idd == I32, "take_along needs f32 values and i32 ids")
    check(len(xs) == len(ids) and tuple(xs[:-1]) == tuple(ids[:-1]),
          f"ids {ids} must match x {xs} on every axis but the last")
    return tuple(ids), F32


def _infer_put_along(shapes, dtypes, attrs):
    return tuple(shapes[1][:-1]) + (attrs["width"],), F32


def group_by_expert(ids, n_expert: int):
    """The slots of ``ids`` [N, k] grouped by expert: [n_expert + 1 + N*k] i32, the
    offsets of each expert's group then the flat slot ids in that order (stable)."""
    return make_node("group_by_expert", [ids], n_expert=int(n_expert))


def _infer_group(shapes, dtypes, attrs):
    check(dtypes[0] == I32 and len(shapes[0]) == 2, f"ids must be [N, k] i32, got {shapes[0]}")
    check(attrs["n_expert"] >= 1, "n_expert must be >= 1")
    n, k = shapes[0]
    return (attrs["n_expert"] + 1 + n * k,), I32


def expert_matmul(x, w, routes, *, trans_b: bool = True):
    """Per slot (n, j) of ``routes``: x[n] (or x[n, j]) @ W[e]^T, e the slot's expert.

    ``x`` [N, n_in] (every slot of token n reads row n) or [N, k, n_in]; ``w``
    [E, n_out, n_in] (``trans_b=False``: [E, n_in, n_out], y = x @ W[e]). The result is
    [N, k, n_out]; each expert's rows are one GEMM, and experts no token chose are never
    read."""
    return make_node("expert_matmul", [x, w, routes], trans_b=bool(trans_b))


def _slots(routes_shape, n_expert: int) -> int:
    return routes_shape[0] - n_expert - 1


def _infer_expert_matmul(shapes, dtypes, attrs):
    (xs, ws, rs), (xd, wd, rd) = shapes, dtypes
    check(xd == F32 and wd == F32 and rd == I32, "expert_matmul needs f32 x and w, i32 routes")
    check(len(ws) == 3, f"w must be [experts, n_out, n_in], got {ws}")
    E = ws[0]
    n_in, n_out = (ws[2], ws[1]) if attrs["trans_b"] else (ws[1], ws[2])
    check(len(xs) in (2, 3) and xs[-1] == n_in, f"x must be [N, {n_in}] or [N, k, {n_in}], got {xs}")
    R = _slots(rs, E)
    check(len(rs) == 1 and R >= xs[0] and R % xs[0] == 0,
          f"routes {rs} do not hold {E} experts' groups of slots of {xs[0]} tokens")
    k = R // xs[0]
    check(len(xs) == 2 or xs[1] == k, f"x {xs} must have {k} slots per token")
    return (xs[0], k, n_out), F32


def _infer_expert_matmul_dw(shapes, dtypes, attrs):
    check_floats(dtypes[:2])
    return tuple(attrs["w_shape"]), F32


def _grad_expert_matmul(n, g, need):
    x, w, routes = n.srcs
    tb = n.attrs["trans_b"]
    gx = gw = None
    if need[0]:  # dx = dy @ W[e] (or W[e]^T); a 2-D x sums its k slots
        gx = expert_matmul(g, w, routes, trans_b=not tb)
        if x.ndim == 2:
            gx = _sum(gx, 1)
    if need[1]:
        gw = make_node("expert_matmul_dw", [g, x, routes], trans_b=tb, w_shape=w.shape)
    return [gx, gw, None]


define_op("topk", _infer_topk)
define_op("take_along", _infer_take_along, lambda n, g, need: [
    make_node("put_along", [g, n.srcs[1]], width=n.srcs[0].shape[-1]), None],
    id_ranges=lambda n: {1: (0, n.srcs[0].shape[-1], f"the last axis of {n.srcs[0].name}")})
define_op("put_along", _infer_put_along)
define_op("group_by_expert", _infer_group,
          id_ranges=lambda n: {0: (0, n.attrs["n_expert"], "the experts")})
define_op("expert_matmul", _infer_expert_matmul, _grad_expert_matmul)
define_op("expert_matmul_dw", _infer_expert_matmul_dw)
