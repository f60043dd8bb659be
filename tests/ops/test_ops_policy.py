"""The policy-gradient loss ops (toygraph/ops/policy/): values against torch in f64
(TRL's expressions), f64 finite-difference gradients, and their CUDA kernels on the host
device against numpy (TOYGRAPH_CUDA_DEVICE=host, as tests/cuda/test_cuda_host.py)."""
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="torch is the reference here: pip install -e '.[reference]'")

from support.gradcheck import TOL, check_gradients, weighted_sum
from support.hostparity import ELEMENTWISE, compare_op
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.session import Session

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _values(rng, shape=(5, 6)):
    logp = rng.normal(size=shape) - 2.0
    old = logp + rng.normal(size=shape) * 0.4     # ratios on both sides of both clip bounds
    adv = rng.normal(size=shape)
    return logp, old, adv


def _run_f64(build, logp, *others):
    g = Graph()
    x = g.param("x", logp)
    ins = [g.input(f"in{i}", v.shape) for i, v in enumerate(others)]
    y = g.output(build(x, *ins))
    s = Session(g, dtype="f64")
    s.realize()
    for t, v in zip(ins, others):
        s.upload(t, v)
    s.run("forward")
    return s.download(y)


def test_clipped_surrogate_is_trls_per_token_loss():
    logp, old, adv = _values(np.random.default_rng(0))
    got = _run_f64(lambda x, o, a: ops.clipped_surrogate(x, o, a, EPS_LOW, EPS_HIGH), logp, old, adv)
    r = torch.exp(torch.tensor(logp) - torch.tensor(old))
    a = torch.tensor(adv)
    want = -torch.min(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-13, atol=1e-15)
    ratio = r.numpy()
    assert ((ratio > 1 + EPS_HIGH) & (adv > 0)).any() and ((ratio < 1 - EPS_LOW) & (adv < 0)).any()


def test_kl_penalty_is_trls_k3_and_keeps_small_differences():
    logp, ref, _ = _values(np.random.default_rng(1))
    got = _run_f64(ops.kl_penalty, logp, ref)
    d = torch.tensor(ref) - torch.tensor(logp)
    np.testing.assert_allclose(got, (torch.exp(d) - d - 1).numpy(), rtol=1e-12, atol=1e-15)
    tiny = _run_f64(ops.kl_penalty, np.full((1, 1), -1.0), np.full((1, 1), -1.0 + 1e-9))
    assert tiny[0, 0] == pytest.approx(0.5e-18, rel=1e-6)   # exp(d) - d - 1 in f64 gives 0


@pytest.mark.parametrize("which", ["surrogate", "kl"])
def test_gradients_reach_the_first_operand_only(which):
    from toygraph.core.autodiff import gradient_map
    logp, old, adv = _values(np.random.default_rng(2), (4, 5))

    def build():
        g = Graph()
        x = g.param("x", logp)
        o = g.param("old", old)          # a param, so a gradient to it would show
        a = g.input("adv", adv.shape)
        y = (ops.clipped_surrogate(x, o, a, EPS_LOW, EPS_HIGH) if which == "surrogate"
             else ops.kl_penalty(x, o))
        return g, x, o, a, weighted_sum(y, np.random.default_rng(5))

    g, x, o, a, loss = build()
    grads = gradient_map(loss, [x, o])
    assert x.id in grads and o.id not in grads
    g, x, o, a, loss = build()
    assert check_gradients(g, loss, [x], {a: adv} if which == "surrogate" else {}) <= TOL


def test_the_gradient_is_zero_where_the_clipped_term_is_the_minimum():
    logp, old, adv = _values(np.random.default_rng(3))
    g = Graph()
    x = g.param("x", logp)
    o, a = g.input("old", old.shape), g.input("adv", adv.shape)
    ops_loss = ops.sum(ops.clipped_surrogate(x, o, a, EPS_LOW, EPS_HIGH))
    from toygraph.core.autodiff import accumulate_grads, backward
    grads = accumulate_grads(backward(g.output(ops_loss), [x]))
    s = Session(g, dtype="f64")
    s.realize()
    s.reset()
    s.upload(o, old)
    s.upload(a, adv)
    s.run("backward")
    got = s.download(grads[x])
    r = np.exp(logp - old)
    clipped = ((r > 1 + EPS_HIGH) & (adv > 0)) | ((r < 1 - EPS_LOW) & (adv < 0))
    assert clipped.any() and (~clipped).any()
    np.testing.assert_array_equal(got[clipped], 0.0)
    np.testing.assert_allclose(got[~clipped], -(r * adv)[~clipped], rtol=1e-13)


# --- the CUDA kernels on the host device -----------------------------------------------------
@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def _constants(*names):
    def make(g, rng):
        shape = (7, 33)
        vals = {"old": rng.normal(size=shape) * 0.4, "adv": rng.normal(size=shape)}
        return {g.input(n, shape): vals[n].astype(np.float32) for n in names}
    return make


def test_clipped_surrogate_cuda_matches_numpy(host_device):
    compare_op(lambda x, o, a: ops.clipped_surrogate(ops.scale(x, 0.4), o, a, EPS_LOW, EPS_HIGH),
               [(7, 33)], ELEMENTWISE, inputs_fn=_constants("old", "adv"))


def test_kl_penalty_cuda_matches_numpy(host_device):
    compare_op(lambda x, o: ops.kl_penalty(ops.scale(x, 0.4), o), [(7, 33)], ELEMENTWISE,
               inputs_fn=_constants("old"))
