"""Reverse-mode differentiation over the graph, by the ops' backward rules (ops/).

>>> grads = backward(loss_sum, params)             # doctest: +SKIP
>>> accs = accumulate_grads(grads)                  # doctest: +SKIP

``backward`` appends gradient nodes only along paths that reach a trainable ``param``;
frozen consts, inputs and anything that does not depend on a param get no gradient node
and no buffer. ``accumulate_grads`` adds each gradient into a ``state`` buffer during the
"backward" phase, so several micro-batches add up until the session resets them.
"""
from __future__ import annotations

from toygraph import ops
from toygraph.core.graph import Tensor, topo_order
from toygraph.ops.groups import PACKED, member
from toygraph.errors import GraphError


def backward(loss: Tensor, params: list[Tensor]) -> dict[Tensor, Tensor]:
    """Gradient nodes of scalar ``loss`` with respect to each of ``params``."""
    grads = gradient_map(loss, params)
    return {p: grads[p.id] for p in params}


def gradient_map(loss: Tensor, params: list[Tensor]) -> dict[int, Tensor]:
    """Like :func:`backward`, but the gradient of every node on a path to a param, by
    node id (what transformations that reorder the backward need to know)."""
    if loss.shape != ():
        raise GraphError(f"backward: loss {loss.name!r} must be a scalar, got {loss.shape}")
    for p in params:
        if p.role != "param":
            raise GraphError(f"backward: {p.name!r} is a {p.role or 'intermediate'}, not a param")
    graph = loss.graph
    order = topo_order([loss])
    # A node needs a gradient when some param lies upstream of it.
    wanted = {p.id for p in params}
    reaches = set()
    for t in order:
        if t.id in wanted or any(s.id in reaches for s in t.srcs):
            reaches.add(t.id)
    missing = [p.name for p in params if p.id not in reaches]
    if missing:
        raise GraphError(f"backward: loss {loss.name!r} does not depend on params {missing}")

    grads: dict[int, Tensor] = {loss.id: graph.scalar(1.0, name=f"d_{loss.name}")}
    views: dict[int, dict[int, Tensor]] = {}   # packing node id -> {view offset: gradient}
    for t in reversed(order):
        if t.op is None:
            continue
        spec = ops.OPS[t.op]
        g = _view_gradients(t, grads, views) if member(t.op, PACKED) else grads.get(t.id)
        if g is None:
            continue
        need = [s.id in reaches for s in t.srcs]
        if not any(need):
            continue
        if _views_packed(t):   # the packing op's rule takes it from here (groups.PACKED)
            parts = views.setdefault(t.srcs[0].id, {})
            at = t.attrs["offset"]
            parts[at] = g if at not in parts else ops.add(parts[at], g)
            continue
        if spec.grad is None:
            raise GraphError(f"backward: op {t.op!r} has no gradient rule")
        rule_out = spec.grad(t, g, need)
        for s, gs, nd in zip(t.srcs, rule_out, need):
            if not nd or gs is None:
                continue
            if gs.shape != s.shape:  # a rule bug, caught at build time rather than at run
                raise GraphError(f"backward: {t.op} gave a {gs.shape} gradient for {s.name} {s.shape}")
            grads[s.id] = gs if s.id not in grads else _sum(grads[s.id], gs, grads, rule_out)
    return grads


def _views_packed(t: Tensor) -> bool:
    """Whether ``t`` is an unpack view of a node whose op packs several results."""
    src = t.srcs[0] if t.op == "unpack" else None
    return src is not None and member(src.op, PACKED)


def _view_gradients(t: Tensor, grads: dict, views: dict) -> dict[int, Tensor] | None:
    """The gradients of packing node ``t``'s views by offset (None: none has one)."""
    if t.id in grads:   # read as a whole: no rule of its op would see that gradient
        raise GraphError(f"backward: {t.op} {t.name!r} packs several results and must be "
                         f"read through unpack views, not as a whole")
    return views.get(t.id)


def _sum(old: Tensor, new: Tensor, grads: dict, rule_out) -> Tensor:
    """old + new, two contributions to one gradient: folded into the backward node that
    made one of them when its op adds in its own kernel (OpSpec.fold_add) and nothing else
    holds that node (it is then computed once, with the add), else an add node."""
    for x, y in ((new, old), (old, new)):
        fold = ops.OPS[x.op].fold_add if x.op else None
        refs = sum(v is x for v in grads.values()) + sum(v is x for v in rule_out)
        if fold and refs == 1:
            fused = fold(x, y)
            if fused is not None:
                return fused
    return ops.add(old, new)


def accumulate_grads(grads: dict[Tensor, Tensor], phase: str = "backward") -> dict[Tensor, Tensor]:
    """Add each gradient into a persistent ``grad`` state buffer; returns param -> buffer."""
    accs = {}
    for p, g in grads.items():
        graph = p.graph
        acc = graph.state(f"grad.{p.name}", p.shape, kind="grad")
        graph.effect(ops.accumulate(acc, g), phase)
        accs[p] = acc
    return accs
