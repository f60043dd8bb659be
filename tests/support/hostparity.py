"""Helpers of the host-executor tests (tests/cuda/test_cuda_host*.py): the CUDA backend run on
the CPU (TOYGRAPH_CUDA_DEVICE=host) against the numpy backend, with tests/cuda/test_cuda.py's
tolerances. Errors are normwise: max|cuda - numpy| / max|numpy| per tensor."""
import numpy as np

import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.gguf import block_encode, blocks
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.core.session import Session

ELEMENTWISE, REDUCTION = 1e-5, 1e-4
MIXED_TOL = {"bf16": 2e-2, "tf32": 5e-3}


def rnd(rng, *shape, s=1.0):
    return (rng.normal(size=shape) * s).astype(np.float32)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run_phase(graph, backend, inputs, phase, fetch, precision="f32", dtype="f32"):
    """Realize ``graph`` on ``backend``, upload ``inputs``, run ``phase``, download ``fetch``
    (``dtype`` "f64": the numpy backend in float64)."""
    s = Session(graph, backend=backend, precision=precision, dtype=dtype)
    s.realize()
    s.reset()
    for t, v in inputs.items():
        s.upload(t, v)
    s.run(phase)
    return [s.download(t) for t in fetch]


def op_case(build, shapes, inputs_fn=None, seed=0):
    """A graph of ``build`` over params of ``shapes`` with loss sum(y * r): the graph, the
    inputs, and the fetch list [y, d loss / d param...]."""
    rng = np.random.default_rng(seed)
    g = Graph()
    params = [g.param(f"p{i}", rnd(rng, *s)) for i, s in enumerate(shapes)]
    extra = inputs_fn(g, rng) if inputs_fn else {}
    y = g.output(build(*params, *extra.keys()))
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, *y.shape))))
    grads = accumulate_grads(backward(loss, params))
    return g, extra, [y] + [grads[p] for p in params]


def compare_op(build, shapes, tol, inputs_fn=None, grad_tol=REDUCTION, precision="f32"):
    """Forward and every param's gradient on the host device within ``tol``/``grad_tol``
    of numpy, and bit-identical when run again."""
    g, extra, fetch = op_case(build, shapes, inputs_fn)
    cpu = run_phase(g, "cpu", extra, "backward", fetch)
    got = run_phase(g, "cuda", extra, "backward", fetch, precision)
    assert rel_err(got[0], cpu[0]) <= tol, ("forward", rel_err(got[0], cpu[0]))
    for i, (a, b) in enumerate(zip(got[1:], cpu[1:])):
        assert rel_err(a, b) <= grad_tol, (f"gradient {i}", rel_err(a, b))
    again = run_phase(g, "cuda", extra, "backward", fetch, precision)
    assert all(np.array_equal(a, b) for a, b in zip(got, again)), "not bit-identical"
    return got


def qlinear(fmt, cols, *, rows, batch, seed=0):
    """y = x @ W^T with W [rows, cols] a block-format const; loss = sum(y * r). Returns the
    graph, W, the fetch list [y, d loss / d x] and their f64 references."""
    rng = np.random.default_rng(seed)
    raw = block_encode.quantize(rnd(rng, rows, cols), fmt)
    g = Graph()
    x = g.param("x", rnd(rng, *batch, cols))
    w = g.const("w", raw, shape=(rows, cols), storage=fmt)
    y = g.output(ops.matmul(x, w, trans_b=True))
    r = rnd(rng, *y.shape)
    loss = ops.sum(ops.mul(y, g.const("r", r)))
    grads = accumulate_grads(backward(loss, [x]))
    wv = blocks.dequantize(raw, fmt, (rows, cols)).astype(np.float64)
    xv = np.asarray(x.data, np.float64)
    return g, w, [y, grads[x]], [xv @ wv.T, r.astype(np.float64) @ wv]


def break_kernel(monkeypatch, old: str, new: str):
    """From now on the CUDA backend compiles its module with ``old`` (found exactly once)
    replaced by ``new``: a deliberately broken kernel for a parity check to catch."""
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    real = sources.backend_source("f32")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    monkeypatch.setattr(cuda_backend, "backend_source",
                        lambda precision="f32": real.replace(old, new))
