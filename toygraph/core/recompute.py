"""Activation checkpointing as a graph transformation: each region (a decoder block, marked
with ``Graph.region``) is recomputed from its saved input during the backward instead of
keeping its activations from the forward.

>>> first = len(graph.nodes)                        # doctest: +SKIP
>>> grads = gradient_map(loss, params)              # doctest: +SKIP
>>> ... accumulate the gradients (backward-phase effects) ...
>>> report = checkpoint_regions(graph, since=first, grads=grads)   # doctest: +SKIP

**Rewiring.** The backward nodes (ids >= ``since``) that read an intermediate of a region
(any node built inside it except its input and output, which stay as the saved
checkpoints) read a clone instead. Clones are made of exactly those intermediates and
their ancestors inside the region, with the same op and attributes; sources outside the
region (its input, consts, params, positions) are shared, never copied. The originals are
then read by the forward only, so the memory planner frees them during the forward; a
clone lives from its recompute to its last backward reader. The values are bit-identical
(same kernels on the same inputs), and autodiff ran before the rewiring, so the backward
sums its gradients in the same order: checkpointed gradients equal the plain ones bit for
bit on a deterministic backend.

**Ordering.** The session schedules a phase depth-first from its targets, placing a node
when something needs it, which alone could recompute every block at the start of the
backward. So each region's recompute gets ordering-only predecessors (``Tensor.after``):
its root clones (those reading no other clone) come after the gradient of the region's
output (block i+1's backward has produced it), after every backward node that reads a
clone of the region above, and after every gradient accumulation of the phase that needs
no clone of a region below that one. Block i+1's recomputed activations and
weight gradients are therefore dead before block i's are made: the arena holds the saved
inputs of every block plus one block's activations, instead of every block's.
"""
from __future__ import annotations

from dataclasses import dataclass

from toygraph.core.graph import Graph, Region, Tensor, topo_order
from toygraph.errors import GraphError


@dataclass
class CheckpointReport:
    """What :func:`checkpoint_regions` did: regions recomputed and nodes cloned."""

    regions: int = 0
    cloned: int = 0
    rewired: int = 0


def checkpoint_regions(graph: Graph, since: int, grads: dict[int, Tensor],
                       phase: str = "backward") -> CheckpointReport:
    """Recompute every region of ``graph`` during ``phase`` from its saved input.

    ``since`` is the id of the first backward node (``len(graph.nodes)`` before autodiff);
    ``grads`` the gradient of each forward node by id (``autodiff.gradient_map``). Call it
    after the backward-phase effects are registered, so their order is arranged too.
    """
    report = CheckpointReport()
    backward_nodes = graph.nodes[since:]
    clone_region: dict[int, int] = {}      # clone id -> region index
    readers: list[list[Tensor]] = []       # per region: backward nodes reading its clones
    roots: list[list[Tensor]] = []
    for index, region in enumerate(graph.regions):
        if region.end > since:
            raise GraphError(f"region {region.name!r} ends after the backward starts")
        clones, read = _rewire(graph, region, backward_nodes)
        clone_region.update((c.id, index) for c in clones.values())
        readers.append(read)
        roots.append([c for c in clones.values() if not any(s.id in clone_region for s in c.srcs)])
        report.cloned += len(clones)
        report.rewired += len(read)
    lowest = _lowest_region(graph, since, clone_region, len(graph.regions))
    # Only gradient accumulations (acc += an intermediate) move earlier: an effect that
    # reads state another effect writes has no edge saying so, and must keep its place.
    effects = [e for e in graph.effects[phase] if e.id >= since and e.op == "accumulate"
               and e.srcs[1].role is None]
    for index, region in enumerate(graph.regions):
        if not roots[index]:
            continue
        grad_out = grads.get(region.output.id)
        if grad_out is None:
            raise GraphError(f"region {region.name!r}: its intermediates are read by the backward "
                             f"but its output {region.output.name!r} has no gradient")
        above = index + 1
        before = readers[above] if above < len(readers) else []
        before = [t for t in before if lowest.get(t.id) == above]
        before += [e for e in effects if lowest.get(e.id, len(graph.regions)) == above]
        for root in roots[index]:
            root.after = (grad_out, *before)
        report.regions += 1
    _check_acyclic(graph.outputs[phase] + graph.effects[phase])
    return report


def _rewire(graph: Graph, region: Region, backward_nodes: list[Tensor]):
    """Clone the intermediates of ``region`` the backward reads (and their ancestors inside
    it); point the backward at the clones. Returns ({original id: clone}, the rewired nodes)."""
    inside = {t.id for t in graph.nodes[region.start:region.end]
              if t.op is not None and t is not region.output}
    read = [t for t in backward_nodes if any(s.id in inside for s in t.srcs)]
    wanted = {s.id for t in read for s in t.srcs if s.id in inside}
    for t in reversed(graph.nodes[region.start:region.end]):  # ids are a topological order
        if t.id in wanted:
            wanted.update(s.id for s in t.srcs if s.id in inside)
    clones: dict[int, Tensor] = {}
    for t in graph.nodes[region.start:region.end]:
        if t.id in wanted:
            srcs = [clones.get(s.id, s) for s in t.srcs]
            clones[t.id] = graph.node(t.op, srcs, t.attrs, name=f"{t.name}.recompute")
    for t in read:
        t.srcs = tuple(clones.get(s.id, s) for s in t.srcs)
    return clones, read


def _lowest_region(graph: Graph, since: int, clone_region: dict[int, int], none: int):
    """For each backward node and clone, the lowest region whose clones it depends on
    (``none`` when it depends on none). Rewired nodes read clones built after them, so
    clones are filled in first; otherwise ids still run in dependency order."""
    lowest = dict(clone_region)
    for t in graph.nodes[since:]:
        if t.id in clone_region:
            continue
        lowest[t.id] = min((lowest.get(s.id, none) for s in t.srcs), default=none)
    return lowest


def _check_acyclic(targets: list[Tensor]) -> None:
    """Ordering edges must never close a cycle: the depth-first scheduler would then place
    a node before a source without noticing. Kahn's count over sources + ``after``."""
    nodes = topo_order(targets)
    waiting = {t.id: len({s.id for s in t.srcs + t.after}) for t in nodes}
    users: dict[int, list[int]] = {}
    for t in nodes:
        for sid in {s.id for s in t.srcs + t.after}:
            users.setdefault(sid, []).append(t.id)
    ready = [t.id for t in nodes if waiting[t.id] == 0]
    placed = 0
    while ready:
        tid = ready.pop()
        placed += 1
        for u in users.get(tid, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if placed != len(nodes):
        raise GraphError("activation checkpointing: the recompute ordering has a cycle "
                         f"({len(nodes) - placed} nodes cannot be scheduled)")
