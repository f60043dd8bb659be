"""Session: buffer reuse, reset semantics, upload validation, determinism, and a toy task."""
import numpy as np
import pytest

from toygraph import ops
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.optimizer import Schedule, build_training, hp_row
from toygraph.core.session import Session


def deep_graph(layers=24, width=64):
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (16, width))
    h = x
    params = []
    for i in range(layers):
        w = g.param(f"w{i}", (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32))
        params.append(w)
        h = ops.silu(ops.rms_norm(h @ w, 1e-5)) + h
    loss = g.output(ops.mean(h * h))
    return g, x, loss, params


def test_liveness_plan_reuses_memory_on_a_deep_graph():
    g, x, loss, params = deep_graph()
    build_training(loss, params)
    plan = Session(g).realize()
    # Forward activations must survive until backward, so reuse cannot be total, but
    # backward temporaries and per-layer scratch share buffers.
    assert plan.arena_bytes < 0.5 * plan.naive_bytes, plan.summary()
    assert plan.pinned_bytes > 0


def test_plan_never_overlaps_live_buffers():
    """Every value read by a node must still hold what its producer wrote: run the deep
    graph and compare with a session whose plan gives every tensor its own bytes."""
    g, x, loss, params = deep_graph(layers=6, width=16)
    step = build_training(loss, params)
    xs = np.random.default_rng(1).normal(size=(16, 16)).astype(np.float32)
    outs = []
    for reuse in (True, False):
        s = Session(g)
        if not reuse:
            import toygraph.core.session as sm
            orig = sm.plan_buffers
            sm.plan_buffers = lambda sched, pinned, isz, pb, storage: _no_reuse(sched, pinned,
                                                                               isz, pb)
        try:
            s.realize()
        finally:
            if not reuse:
                sm.plan_buffers = orig
        s.reset(); s.upload(x, xs); s.upload(step.hp, hp_row(1, 1e-2)); s.run("step")
        outs.append([s.download(p) for p in params] + [s.download(loss)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def _no_reuse(schedule, pinned, itemsize, pinned_bytes):
    from toygraph.core.buffer_plan import BufferPlan, aligned, is_planned
    plan = BufferPlan(pinned_bytes=pinned_bytes)
    for t in schedule:
        if is_planned(t, pinned):
            plan.offsets[t.id] = plan.arena_bytes
            plan.arena_bytes += aligned(max(1, t.size) * itemsize)
    plan.naive_bytes = plan.arena_bytes
    return plan


def mlp(seed=0):
    rng = np.random.default_rng(seed)
    g = Graph()
    x, lab = g.input("x", (4, 3)), g.input("lab", (4,), "i32")
    w = g.param("w", rng.normal(size=(3, 5)).astype(np.float32))
    table = g.param("table", rng.normal(size=(6, 3)).astype(np.float32))
    ids = g.input("ids", (4,), "i32")
    logits = (x + ops.get_rows(table, ids)) @ w
    loss = g.output(ops.cross_entropy(logits, lab))
    step = build_training(ops.cross_entropy(logits, lab, "sum"), [w, table],
                          count=ops.count_valid(lab))
    s = Session(g)
    s.realize()
    return s, g, x, lab, ids, w, loss, step


def feed(s, x, lab, ids, step, t=1):
    s.upload(x, np.ones((4, 3), np.float32))
    s.upload(lab, np.array([0, 1, -1, 4], np.int32))
    s.upload(ids, np.array([0, 5, 2, 2], np.int32))
    s.upload(step.hp, hp_row(t, 1e-2))


def test_reset_vs_reset_grads():
    s, g, x, lab, ids, w, loss, step = mlp()
    s.reset()
    feed(s, x, lab, ids, step)
    s.run("backward")
    grad = s.download(step.grads[w])
    m, _ = step.moments[w]
    s.run("backward")  # accumulates: twice the gradient, twice the count
    np.testing.assert_allclose(s.download(step.grads[w]), 2 * grad, rtol=1e-6)
    assert float(s.download(step.count)) == 6.0
    s.run("step")
    assert np.any(s.download(m))
    s.reset_grads()
    assert not np.any(s.download(step.grads[w])) and float(s.download(step.count)) == 0
    assert np.any(s.download(m))            # moments survive reset_grads
    s.reset()
    assert not np.any(s.download(m))        # ... but not reset


def test_bad_uploads_raise_clear_errors():
    s, g, x, lab, ids, w, loss, step = mlp()
    with pytest.raises(GraphError, match=r"upload 'x': expected shape \(4, 3\), got \(3, 4\)"):
        s.upload(x, np.ones((3, 4), np.float32))
    with pytest.raises(GraphError, match="expected integer ids"):
        s.upload(ids, np.zeros(4, np.float32))
    with pytest.raises(GraphError, match=r"value 6 outside \[0, 6\) \(rows of table\)"):
        s.upload(ids, np.array([0, 6, 1, 1]))
    with pytest.raises(GraphError, match=r"value -2 outside \[-1, 5\)"):
        s.upload(lab, np.array([0, -2, 1, 1]))
    with pytest.raises(GraphError, match=r"value 5 outside \[-1, 5\)"):
        s.upload(lab, np.array([0, 5, 1, 1]))
    bad_hp = hp_row(1, 1e-3)
    bad_hp[0] = np.nan
    with pytest.raises(GraphError, match="'hp': contains NaN"):
        s.upload(step.hp, bad_hp)
    with pytest.raises(GraphError, match="expected floating"):
        s.upload(x, np.ones((4, 3), np.int64))
    with pytest.raises(GraphError, match="not an input"):
        s.upload(w, np.ones((3, 5), np.float32))
    with pytest.raises(GraphError, match="never uploaded"):
        s.run("forward")
    with pytest.raises(GraphError, match="phase"):
        s.run("sideways")
    logits = next(t for t in g.nodes if t.op == "matmul")
    with pytest.raises(GraphError, match="intermediate"):
        s.download(logits)


def test_unrealized_session_refuses_work():
    g = Graph()
    x = g.input("x", (2,))
    g.output(ops.sum(x))
    s = Session(g)
    with pytest.raises(GraphError, match="realize"):
        s.upload(x, np.ones(2, np.float32))
    with pytest.raises(GraphError, match="backend"):
        Session(g, backend="tpu")


def test_same_graph_twice_is_bit_identical():
    results = []
    for _ in range(2):
        s, g, x, lab, ids, w, loss, step = mlp(seed=3)
        s.reset()
        losses = []
        for t in range(1, 4):
            s.reset_grads()
            feed(s, x, lab, ids, step, t)
            s.run("step")
            losses.append(s.download(loss).tobytes())
        results.append((losses, s.download(w).tobytes()))
    assert results[0] == results[1]


def test_tiny_model_learns_a_toy_task_to_near_optimum():
    """A one-layer embedding model learns 'next token = (token + 1) mod V' on a stream
    where 80% of transitions follow that rule and 20% are uniform noise over V symbols.
    The optimal loss is the entropy of that mixture: -(p log p + (1-p) log q) with
    p = 0.8 + 0.2/V and q = 0.2/V for the V-1 wrong symbols."""
    V, D, N = 8, 16, 256
    rng = np.random.default_rng(0)
    g = Graph()
    ids, lab = g.input("ids", (N,), "i32"), g.input("lab", (N,), "i32")
    emb = g.param("emb", (rng.normal(size=(V, D)) * 0.1).astype(np.float32))
    w = g.param("w", (rng.normal(size=(D, V)) * 0.1).astype(np.float32))
    logits = ops.get_rows(emb, ids) @ w
    g.output(ops.cross_entropy(logits, lab))
    step = build_training(ops.cross_entropy(logits, lab, "sum"), [emb, w],
                          count=ops.count_valid(lab), max_norm=1.0)
    s = Session(g)
    s.realize()
    s.reset()
    p = 0.8 + 0.2 / V
    optimum = -(p * np.log(p) + (V - 1) * (0.2 / V) * np.log(0.2 / V))
    lr = Schedule(0.05, "cosine", warmup=10, total=400, floor=1e-3)
    for t in range(1, 401):
        x = rng.integers(0, V, N)
        y = np.where(rng.random(N) < 0.8, (x + 1) % V, rng.integers(0, V, N))
        s.reset_grads()
        s.upload(ids, x), s.upload(lab, y), s.upload(step.hp, hp_row(t, lr(t)))
        s.run("step")
    # Evaluate on a large fresh sample with the trained weights.
    E, Wt = s.download(emb), s.download(w)
    x = rng.integers(0, V, 200000)
    y = np.where(rng.random(200000) < 0.8, (x + 1) % V, rng.integers(0, V, 200000))
    z = E[x] @ Wt
    z -= z.max(1, keepdims=True)
    final = float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]))
    print(f"toy task: optimum {optimum:.4f}, trained {final:.4f}, start {np.log(V):.4f}")
    assert final < optimum + 0.015  # optimum 0.8043; uniform guessing is ln 8 = 2.0794


# --- backends by name (core/backends.py) ------------------------------------------------------
def test_the_cuda_backend_is_found_by_name_without_the_core_importing_it(tmp_path):
    """In a fresh interpreter, the session and its backend registry leave toygraph.cuda
    unimported, and Session(backend="cuda") then loads it through its entry point (run on
    the host executor, so no GPU is needed)."""
    import subprocess
    import sys
    code = """
import sys
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.session import Session
runtime = [m for m in sys.modules if m.startswith("toygraph.cuda.")
           and not m.startswith("toygraph.ops.lowering")]   # the API below the core aside
assert not runtime, runtime
g = Graph()
x = g.input("x", (3,))
y = g.output(ops.scale(x, 2.0))
s = Session(g, backend="cuda")
print(type(s.backend).__module__)
"""
    env = {**__import__("os").environ, "TOYGRAPH_CUDA_DEVICE": "host"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "toygraph.cuda.backend"


def test_a_backend_nothing_registers_is_a_clear_error(monkeypatch):
    from toygraph.core import backends
    monkeypatch.setattr(backends, "FACTORIES", {"cpu": backends.FACTORIES["cpu"]})
    monkeypatch.setattr(backends, "entry_points", lambda **kw: [])
    g = Graph()
    g.output(ops.sum(g.input("x", (2,))))
    with pytest.raises(GraphError, match="backend 'cuda' is not installed: no entry point 'cuda' "
                                         "in the group 'toygraph.backends'"):
        Session(g, backend="cuda")
    with pytest.raises(GraphError, match="backend must be 'cpu' or 'cuda', got 'tpu'"):
        Session(g, backend="tpu")
