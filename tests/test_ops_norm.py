"""The row-wise normalisations (ops/norm.py: rms_norm, softmax): f64 finite-difference
gradients, the per-head q/k norm of Qwen3 and Gemma 3 (rms_norm of [B, T, H, hd] times a
[hd] weight), and its CUDA launches (rows over head_dim)."""
import numpy as np
import pytest

from gradcheck import TOL, check_gradients, gradcheck_unary, rnd, weighted_sum
from toygraph.core import ops
from toygraph.cuda.lowering import dispatch
from toygraph.core.graph import Graph


@pytest.mark.parametrize("name,build,shape", [
    ("rms_norm", lambda x: ops.rms_norm(x, 1e-5), (2, 3, 8)),
    ("softmax", lambda x: ops.softmax(x, scale=0.7), (2, 5)),
    ("softmax_causal", lambda x: ops.softmax(x, scale=0.5, causal=True), (2, 3, 4, 4)),
])
def test_unary_gradients(name, build, shape):
    assert gradcheck_unary(build, shape) <= TOL


# --- per-head q/k norm (Qwen3, Gemma 3): rms_norm of [B, T, H, hd] times a [hd] weight -------
def test_per_head_rms_norm_times_weight_gradient():
    rng = np.random.default_rng(28)
    g = Graph()
    x, w = g.param("x", rnd(rng, 2, 3, 4, 5)), g.param("w", rnd(rng, 5))
    y = ops.mul(ops.rms_norm(x, 1e-6), w)
    assert check_gradients(g, weighted_sum(y, rng), [x, w], {}) <= TOL


def test_per_head_rms_norm_lowers_to_rows_over_head_dim():
    g = Graph()
    x = g.const("x", np.zeros((2, 3, 4, 40)))
    for node in (ops.rms_norm(x, 1e-6), ops.OPS["rms_norm"].grad(ops.rms_norm(x, 1e-6), x,
                                                                  [True])[0]):
        (launch,) = dispatch.lower(node, lambda t: (t.id + 1) << 20)
        rows, D = (int(v[0]) for v in launch.args[-3:-1])
        assert (launch.kernel, rows, D) == ("tg_" + node.op, 24, 40)
