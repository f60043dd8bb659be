"""Finite-difference gradient checks in float64, shared by the op and model tests."""
from __future__ import annotations

import numpy as np

from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.core.session import Session


def weighted_sum(y, rng):
    """A scalar loss sum(y * r) with fixed random r, so every output element matters."""
    r = y.graph.const(f"r{y.id}", rng.normal(size=y.shape))
    return ops.sum(ops.mul(y, r))


def check_gradients(graph: Graph, loss, params, inputs: dict, eps=1e-6, max_elems=60, seed=0):
    """Max over params of max|analytic - numeric| / max|numeric| (central differences, f64).

    Checks at most ``max_elems`` randomly chosen entries per param to keep it quick.
    """
    graph.output(loss)
    accumulate_grads(backward(loss, params))
    sess = Session(graph, backend="cpu", dtype="f64")
    sess.realize()
    sess.reset()
    for t, v in inputs.items():
        sess.upload(t, v)
    sess.run("backward")
    analytic = {p: sess.download(graph.find(f"grad.{p.name}")) for p in params}
    rng = np.random.default_rng(seed)
    worst = 0.0
    for p in params:
        base = sess.download(p)
        flat = base.ravel()
        idx = rng.choice(flat.size, size=min(max_elems, flat.size), replace=False)
        numeric = np.zeros(len(idx))
        for j, i in enumerate(idx):
            vals = []
            for d in (eps, -eps):
                pert = flat.copy()
                pert[i] += d
                sess.load_param(p, pert.reshape(base.shape))
                sess.run("forward")
                vals.append(float(sess.download(loss)))
            numeric[j] = (vals[0] - vals[1]) / (2 * eps)
        sess.load_param(p, base)
        a = analytic[p].ravel()[idx]
        scale = max(np.abs(numeric).max(), 1e-12)
        worst = max(worst, float(np.abs(a - numeric).max() / scale))
    return worst


#: The largest relative error a gradient check of an op may show.
TOL = 1e-6


def rnd(rng, *shape, s=1.0):
    return (rng.normal(size=shape) * s).astype(np.float32)


def gradcheck_unary(build, shape, seed=0, positive=False):
    """check_gradients of weighted_sum(build(x)) for one random param x of ``shape``."""
    rng = np.random.default_rng(seed)
    g = Graph()
    init = rnd(rng, *shape)
    if positive:
        init = np.abs(init) + 0.5
    x = g.param("x", init)
    loss = weighted_sum(build(x), rng)
    return check_gradients(g, loss, [x], {})


def forward_f64(g, inputs=None):
    """A realized f64 numpy session of ``g`` with ``inputs`` uploaded, forward run."""
    s = Session(g, dtype="f64")
    s.realize()
    for t, v in (inputs or {}).items():
        s.upload(t, v)
    s.run("forward")
    return s
