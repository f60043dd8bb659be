"""The buffer plan's views (core/buffer_plan.py): reshape, contiguous and aligned unpacks of arena
intermediates take no bytes and launch nothing, while pinned results, unaligned unpacks and
sources outside the arena keep their copies; a training step with views gives the same bits
as with none (numpy and the CUDA kernels on the host executor), and no buffer placed while a
view is still to be read overlaps the bytes it views."""
import numpy as np
import pytest

from support.cudaemu import lora_graph, training_plan
from toygraph import ops
from toygraph.core import buffer_plan
from toygraph.ops import groups
from toygraph.core.graph import Graph
from toygraph.core.session import Session


def _graph():
    g = Graph()
    x = g.param("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    a = ops.scale(x, 2.0)                                  # an arena intermediate
    r = a.reshape(4, 3)                                    # a view of a
    u_ok = ops.unpack(a, 0, (2, 2))                        # offset 0: a view
    u_odd = ops.unpack(a, 1, (2, 2))                       # 4 bytes in: a copy
    pinned = g.output(a.reshape(12))                       # an output: its own buffer
    y = g.output(ops.sum(r) + ops.sum(u_ok) + ops.sum(u_odd))
    return g, a, r, u_ok, u_odd, pinned, y


def test_which_nodes_are_views():
    g, a, r, u_ok, u_odd, pinned, y = _graph()
    s = Session(g, backend="cpu")
    plan = s.realize()
    assert plan.offsets[r.id] == plan.offsets[u_ok.id] == plan.offsets[a.id]
    assert plan.offsets[u_odd.id] != plan.offsets[a.id] + 4      # its own bytes
    assert pinned.id not in plan.offsets
    s.run("forward")
    want = 2 * np.arange(12.0)
    assert s.download(y) == want.sum() + want[:4].sum() + want[1:5].sum()
    assert np.array_equal(s.download(pinned), want)


def _no_overlap_while_viewed(order, pinned, plan):
    """Every placed tensor's bytes against every other's still live (views resolved)."""
    root = buffer_plan.views(order, pinned, 4)
    last = {}
    for i, t in enumerate(order):
        for src in t.srcs:
            last[root.get(src.id, src.id)] = i
    placed = [(i, t) for i, t in enumerate(order) if t.id in plan.offsets and t.id not in root]
    for i, t in placed:
        lo, hi = plan.offsets[t.id], plan.offsets[t.id] + 4 * t.size
        for j, u in placed:
            if j < i <= last.get(u.id, j):     # u is made before t and read at or after it
                ulo, uhi = plan.offsets[u.id], plan.offsets[u.id] + 4 * u.size
                assert hi <= ulo or uhi <= lo, (t.name, u.name)


def test_a_training_plan_never_overwrites_viewed_bytes(tiny_llama):
    order, pinned, plan, _ = training_plan(lora_graph(tiny_llama, ("q", "v", "gate", "up")))
    assert sum(1 for t in order if t.id in buffer_plan.views(order, pinned, 4)) > 10
    _no_overlap_while_viewed(order, pinned, plan)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_views_change_no_bit_of_a_training_step(tiny_llama, backend, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")

    def step():
        g = lora_graph(tiny_llama, ("q", "v", "gate", "up"))
        s = Session(g, backend=backend)
        s.realize()
        s.reset()
        rng = np.random.default_rng(0)
        from toygraph.core.optimizer import hp_row
        for t in g.nodes:
            if t.role == "input" and t.dtype == "i32":
                s.upload(t, rng.integers(0, 32, t.shape))
        s.upload("hp", hp_row(1, lr=1e-2))
        s.run("step")
        return [s.download(t) for t in g.nodes if t.role == "param" or
                (t.role == "state" and t.kind == "grad")]
    with_views = step()
    monkeypatch.setitem(groups.MEMBERS, groups.VIEW, frozenset())   # no op makes a view
    without = step()
    assert len(with_views) == len(without) > 0
    assert all(np.array_equal(a, b) for a, b in zip(with_views, without))
