"""The Gated DeltaNet ops (ops/deltanet/), narrow (ops/slicing/) and sigmoid: f64 finite-difference gradients of
every input; the chunked (WY) forward against the step-wise recurrence written out here and
against transformers' own torch functions; the state hand-over of generation; and the CUDA
kernels on the host executor against numpy (forward and backward, ragged chunk edges)."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from support.hostparity import ELEMENTWISE, REDUCTION, compare_op, rel_err
from support.tiers import one_by_default
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from toygraph.errors import GraphError


def delta_inputs(rng, B=2, T=7, H=3, dk=4, dv=5):
    """q, k unit vectors per head (as the model feeds them), decays g < 0, beta in (0, 1)."""
    q, k = rnd(rng, B, T, H, dk), rnd(rng, B, T, H, dk)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.abs(rnd(rng, B, T, H, s=0.7))
    beta = 1 / (1 + np.exp(-rnd(rng, B, T, H)))
    return q, k, rnd(rng, B, T, H, dv), g.astype(np.float32), beta.astype(np.float32)


def stepwise(q, k, v, g, beta, S=None):
    """The recurrence, one step at a time (float64): o [B, T, H, dv] and the final state."""
    B, T, H, dk = q.shape
    S = np.zeros((B, H, dk, v.shape[-1])) if S is None else np.array(S, np.float64)
    o = np.zeros(v.shape)
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None]
        err = v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + k[:, t][..., :, None] * (beta[:, t][..., None] * err)[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def run(build, arrays):
    g = Graph()
    out = g.output(build(g, *[g.const(f"x{i}", a) for i, a in enumerate(arrays)]))
    s = Session(g)
    s.realize()
    s.run("forward")
    return s.download(out)


@pytest.mark.parametrize("T,chunk", [(7, 3), (8, 4), (5, 64), (1, 64)])
def test_chunked_forward_is_the_recurrence(T, chunk):
    x = delta_inputs(np.random.default_rng(T), T=T)
    got = run(lambda g, *s: ops.delta_rule(*s, chunk=chunk), x)
    np.testing.assert_allclose(got, stepwise(*x)[0], rtol=0, atol=2e-6)


def test_matches_transformers_chunked_and_recurrent_functions():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    q, k, v, g, beta = delta_inputs(np.random.default_rng(3), T=70)   # two chunks of 64
    t = [torch.tensor(a) for a in (q, k, v, g, beta)]
    scale = q.shape[-1] ** 0.5   # transformers scales q inside; the op takes it scaled
    want, _ = m.torch_chunk_gated_delta_rule(t[0] * scale, *t[1:], chunk_size=64)
    rec, _ = m.torch_recurrent_gated_delta_rule(t[0] * scale, *t[1:])
    got = run(lambda gr, *s: ops.delta_rule(*s), (q, k, v, g, beta))
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-5)
    np.testing.assert_allclose(got, rec.numpy(), rtol=0, atol=2e-5)


def test_state_in_and_out_continue_the_sequence():
    """Generation: the prompt's final state, fed to the next token, gives what the whole
    sequence gives; the state version has no gradient."""
    x = delta_inputs(np.random.default_rng(5), T=6)
    full_o, full_S = stepwise(*x)
    S0 = np.zeros((2, 3, 4, 5), np.float32)
    head = [a[:, :5] for a in x]
    tail = [a[:, 5:] for a in x]
    g = Graph()
    o1, S1 = ops.delta_rule(*[g.const(f"a{i}", a) for i, a in enumerate(head)], g.const("S0", S0))
    o2, S2 = ops.delta_rule(*[g.const(f"b{i}", a) for i, a in enumerate(tail)], S1)
    node = o1.srcs[0]
    outs = [g.output(t) for t in (o1, o2, S2)]
    s = Session(g)
    s.realize()
    s.run("forward")
    o1, o2, S2 = (s.download(t) for t in outs)
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), full_o, atol=2e-6)
    np.testing.assert_allclose(S2, full_S, atol=2e-6)
    with pytest.raises(GraphError, match="no gradient"):
        ops.OPS["delta_rule"].grad(node, g.const("gg", np.ones(node.shape)), [True] * 6)


@pytest.mark.parametrize("T,chunk", [(7, 3), (6, 64)])
def test_delta_rule_gradients(T, chunk):
    rng = np.random.default_rng(7)
    g = Graph()
    params = [g.param(n, a) for n, a in zip("qkvgb", delta_inputs(rng, T=T))]
    y = ops.delta_rule(*params, chunk=chunk)
    assert check_gradients(g, weighted_sum(y, rng), params, {}) <= TOL


def test_conv_is_causal_and_depthwise():
    rng = np.random.default_rng(1)
    x, w = rnd(rng, 2, 6, 3), rnd(rng, 3, 4)
    got = run(lambda g, a, b: ops.causal_conv1d(a, b), (x, w))
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.conv1d(torch.tensor(x).transpose(1, 2), torch.tensor(w)[:, None],
                                      padding=3, groups=3)[..., :6].transpose(1, 2)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6)


@pytest.mark.parametrize("T", [6, 2])
def test_conv_gradients(T):
    rng = np.random.default_rng(2)
    g = Graph()
    x, w = g.param("x", rnd(rng, 2, T, 3)), g.param("w", rnd(rng, 3, 4))
    assert check_gradients(g, weighted_sum(ops.causal_conv1d(x, w), rng), [x, w], {}) <= TOL


def test_narrow_gradient_and_bounds():
    rng = np.random.default_rng(4)
    g = Graph()
    x = g.param("x", rnd(rng, 2, 3, 6))
    y = ops.narrow(x, 2, 3)
    assert y.shape == (2, 3, 3)
    assert check_gradients(g, weighted_sum(y, rng), [x], {}) <= TOL
    with pytest.raises(GraphError, match="inside the last axis"):
        ops.narrow(x, 4, 3)


def test_sigmoid_gradient_and_values():
    rng = np.random.default_rng(3)
    g = Graph()
    x = g.param("x", rnd(rng, 3, 5, s=4.0))
    assert check_gradients(g, weighted_sum(ops.sigmoid(x), rng), [x], {}) <= TOL
    xv = np.array([-200.0, -3.0, 0.0, 2.0, 200.0], np.float32)
    np.testing.assert_allclose(run(lambda gr, a: ops.sigmoid(a), (xv,)),
                               1 / (1 + np.exp(-xv.astype(np.float64))), rtol=1e-6, atol=1e-30)


# --- the CUDA kernels on the host executor ---------------------------------------------------
@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


@pytest.mark.parametrize("name,build,shapes,tol", [
    ("sigmoid", lambda x: ops.sigmoid(ops.scale(x, 5.0)), [(7, 300)], ELEMENTWISE),
    ("conv", ops.causal_conv1d, [(2, 37, 5), (5, 4)], REDUCTION),
    ("conv_short", ops.causal_conv1d, [(1, 2, 3), (3, 4)], REDUCTION),
    ("narrow", lambda x: ops.narrow(x, 3, 7), [(2, 5, 12)], ELEMENTWISE),
])
def test_kernels_match_numpy(host_device, name, build, shapes, tol):
    compare_op(build, shapes, tol)


def _delta_case(B, T, H, dk, dv, chunk, seed=11):
    """The delta rule's output and every input's gradient (loss = a weighted sum of o)."""
    from toygraph.core.autodiff import accumulate_grads, backward
    rng = np.random.default_rng(seed)
    g = Graph()
    params = [g.param(n, a) for n, a in zip("qkvgb", delta_inputs(rng, B, T, H, dk, dv))]
    y = g.output(ops.delta_rule(*params, chunk=chunk))
    grads = accumulate_grads(backward(weighted_sum(y, rng), params))
    return g, [y] + [grads[p] for p in params]


def _delta_errors(B, T, H, dk, dv, chunk):
    """rel_err of the CUDA chunked kernels (host executor) against numpy for o, dq, dk, dv,
    dg, dbeta; and whether a second run is bit-identical."""
    from support.hostparity import run_phase
    g, fetch = _delta_case(B, T, H, dk, dv, chunk)
    cpu = run_phase(g, "cpu", {}, "backward", fetch)
    got = run_phase(g, "cuda", {}, "backward", fetch)
    again = run_phase(g, "cuda", {}, "backward", fetch)
    errors = {n: rel_err(a, b) for n, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, cpu)}
    return errors, all(np.array_equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("B,T,H,dk,dv,chunk", [
    (2, 37, 3, 4, 5, 16),      # three chunks, the last ragged
    (1, 150, 2, 16, 24, 64),   # the default chunk: two full chunks and 22 steps
    (2, 70, 3, 32, 16, 64),    # dk > dv
    (1, 130, 2, 8, 8, 100),    # a chunk past the kernels' bound runs as DELTA_CHUNK
    (1, 5, 4, 8, 300, 64),     # more state columns than threads, shorter than a chunk
])
def test_delta_rule_kernels_match_numpy(host_device, B, T, H, dk, dv, chunk):
    """The chunked forward and backward kernels against numpy (the WY forward, the
    chunk-start + step-wise backward), every gradient, and bit-identical when run again."""
    errors, repeatable = _delta_errors(B, T, H, dk, dv, chunk)
    print((B, T, H, dk, dv, chunk), {n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) <= REDUCTION, errors
    assert repeatable


# One index expression each, as a careless edit would change it: the parity check that
# passes on the real source must fail.
DELTA_MUTATIONS = {
    "the forward's output skips the diagonal of M":
        ("for (int l = 0; l <= i; ++l) o = __fadd_rn", "for (int l = 0; l < i; ++l) o = __fadd_rn"),
    "the back-substitution drops the chunk's last row":
        ("for (int l = i + 1; l < n; ++l)", "for (int l = i + 1; l < n - 1; ++l)"),
    "dU reads its own step's output gradient for every later step":
        ("w.M[l * C + i], dout[TG_ROW(l) * dv + j]", "w.M[l * C + i], dout[TG_ROW(i) * dv + j]"),
}


@pytest.mark.parametrize("mutation", one_by_default(DELTA_MUTATIONS))
def test_a_broken_delta_kernel_fails_its_parity_check(host_device, mutation, monkeypatch):
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    old, new = DELTA_MUTATIONS[mutation]
    real = sources.backend_source("f32")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    broken = real.replace(old, new)
    monkeypatch.setattr(cuda_backend, "backend_source", lambda precision="f32": broken)
    errors, _ = _delta_errors(1, 70, 2, 8, 8, 64)
    assert max(errors.values()) > 1e-2, errors


@pytest.mark.parametrize("T", [1, 70])
def test_delta_rule_with_state_kernel_matches_numpy(host_device, T):
    """From a given state: decoding (T = 1) runs the step-wise kernel, a prompt the chunked
    one; o and the final state against numpy."""
    from support.hostparity import run_phase
    rng = np.random.default_rng(12)
    g = Graph()
    x = [g.const(n, a) for n, a in zip("qkvgb", delta_inputs(rng, T=T))]
    o, S = ops.delta_rule(*x, g.const("S0", rnd(rng, 2, 3, 4, 5)))
    fetch = [g.output(o), g.output(S)]
    cpu = run_phase(g, "cpu", {}, "forward", fetch)
    got = run_phase(g, "cuda", {}, "forward", fetch)
    assert all(rel_err(a, b) <= REDUCTION for a, b in zip(got, cpu))
    kernels = {launch.kernel for launch in _launches(o)}
    assert kernels == {"tg_delta_rule" if T == 1 else "tg_delta_chunked"}


def _launches(t):
    from toygraph.ops.lowering import dispatch
    node = t.srcs[0] if t.op != "delta_rule" else t
    return dispatch.lower(node, lambda s: 4096, scratch=8192)
