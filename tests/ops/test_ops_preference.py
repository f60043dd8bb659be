"""The preference-loss ops (toygraph/ops/preference/): values against torch in f64, f64
finite-difference gradients, and their CUDA kernels on the host device against numpy
(TOYGRAPH_CUDA_DEVICE=host, as tests/cuda/test_cuda_host.py)."""
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="torch is the reference here: pip install -e '.[reference]'")

from support.gradcheck import check_gradients, weighted_sum
from support.hostparity import ELEMENTWISE, REDUCTION, compare_op, rnd
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.session import Session

TOL = 1e-6


def _forward_f64(build, x, extra=None):
    g = Graph()
    p = g.param("x", x)
    inputs = {}
    srcs = [p]
    for name, v in (extra or {}).items():
        t = g.input(name, v.shape, "i32")
        inputs[t] = v
        srcs.append(t)
    y = g.output(build(*srcs))
    s = Session(g, dtype="f64")
    s.realize()
    for t, v in inputs.items():
        s.upload(t, v)
    s.run("forward")
    return s.download(y)


LABELS = np.array([1, -1, 5, 0, -1, 3], np.int32)


def test_token_logprobs_values_match_torch_log_softmax():
    x = np.random.default_rng(1).normal(size=(6, 7)) * 3
    got = _forward_f64(ops.token_logprobs, x, {"lab": LABELS})
    lp = torch.log_softmax(torch.tensor(x), -1)
    want = np.where(LABELS >= 0, lp[np.arange(6), np.maximum(LABELS, 0)].numpy(), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_softplus_log_sigmoid_log1mexp_values_match_torch_at_extremes():
    x = np.array([-800.0, -40.0, -1.0, -1e-9, 0.0, 1e-9, 2.0, 40.0, 800.0])
    np.testing.assert_allclose(_forward_f64(ops.softplus, x),
                               torch.nn.functional.softplus(torch.tensor(x)).numpy(),
                               rtol=1e-12, atol=0)
    np.testing.assert_allclose(_forward_f64(ops.log_sigmoid, x),
                               torch.nn.functional.logsigmoid(torch.tensor(x)).numpy(), rtol=1e-12)
    neg = np.array([-800.0, -40.0, -0.7, -0.69, -1e-3, -1e-12])
    want = np.log(-np.expm1(np.float64(neg)))  # exact in f64 on these points
    want[:2] = np.log1p(-np.exp(neg[:2]))
    np.testing.assert_allclose(_forward_f64(ops.log1mexp, neg), want, rtol=1e-12)
    assert np.isfinite(_forward_f64(ops.log1mexp, np.array([-1e-30]))).all()


def test_token_logprobs_gradient():
    rng = np.random.default_rng(2)
    g = Graph()
    logits = g.param("logits", rnd(rng, 6, 7, s=2.0))
    lab = g.input("lab", (6,), "i32")
    loss = weighted_sum(ops.token_logprobs(logits, lab), rng)
    assert check_gradients(g, loss, [logits], {lab: LABELS}) <= TOL


@pytest.mark.parametrize("op,lo,hi", [(ops.softplus, -30, 30), (ops.log_sigmoid, -30, 30),
                                      (ops.log1mexp, -8, -0.01)])
def test_pointwise_gradients(op, lo, hi):
    rng = np.random.default_rng(3)
    g = Graph()
    x = g.param("x", rng.uniform(lo, hi, size=(4, 5)))
    assert check_gradients(g, weighted_sum(op(x), rng), [x], {}) <= TOL


# --- the CUDA kernels on the host device -----------------------------------------------------
@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


@pytest.mark.parametrize("labels", [[1, -1, 299, 0, -1], [-1, -1, -1, -1, -1]])
def test_token_logprobs_cuda_matches_numpy(host_device, labels):
    def lab(g, rng):
        return {g.input("lab", (5,), "i32"): np.array(labels, np.int32)}
    compare_op(ops.token_logprobs, [(5, 300)], REDUCTION, inputs_fn=lab)




@pytest.mark.parametrize("op", [ops.softplus, ops.log_sigmoid])
def test_softplus_cuda_matches_numpy(host_device, op):
    compare_op(lambda x: op(ops.scale(x, 30.0)), [(7, 33)], ELEMENTWISE)


def test_log1mexp_cuda_matches_numpy_on_both_branches(host_device):
    # -softplus(x) spreads N(0, 1) samples over (-inf, 0): both sides of -ln 2.
    compare_op(lambda x: ops.log1mexp(ops.scale(ops.softplus(ops.scale(x, 3.0)), -1.0)),
               [(7, 33)], ELEMENTWISE)
