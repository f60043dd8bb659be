"""The row-wise normalisations (ops/norm/: rms_norm, softmax, inv_row_norm): f64
finite-difference gradients, the per-head q/k norm of Qwen3 and Gemma 3 (rms_norm of
[B, T, H, hd] times a [hd] weight), and its CUDA launches (rows over head_dim); DoRA's
detached norm and the gradients of the DoRA layer built on it; the weight in the norm's
kernel (the very bits of the norm then a mul, with a frozen or a trainable weight) and the
residual stream's gradient folded into rms_norm_back."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, gradcheck_unary, rnd, weighted_sum
from support.tiers import one_by_default
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.ops.lowering import dispatch
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
    w = g.const("w", np.ones(40))
    for node in (ops.rms_norm(x, 1e-6), ops.OPS["rms_norm"].grad(ops.rms_norm(x, 1e-6), x,
                                                                  [True])[0]):
        (launch,) = dispatch.lower(node, lambda t: (t.id + 1) << 20)
        rows, D = (int(v[0]) for v in launch.args[-4:-2])
        assert (launch.kernel, rows, D) == ("tg_" + node.op, 24, 40)
    (launch,) = dispatch.lower(ops.rms_norm(x, 1e-6, weight=w), lambda t: (t.id + 1) << 20)
    assert [int(v[0]) for v in launch.args[2:4]] == [(w.id + 1) << 20, 0]   # one [hd] row


# --- inv_row_norm: DoRA's detached 1 / ||row|| ------------------------------------------------
def _run_f64(g, fetch, params_values=None):
    from toygraph.core.session import Session
    sess = Session(g, backend="cpu", dtype="f64")
    sess.realize()
    sess.reset()
    sess.run("backward")
    return [sess.download(t) for t in fetch]


def test_inv_row_norm_is_one_over_the_row_norm_and_passes_no_gradient():
    from toygraph.core.autodiff import accumulate_grads, backward
    rng = np.random.default_rng(3)
    g = Graph()
    xv = rnd(rng, 4, 3, 9)
    x = g.param("x", xv)
    r1, r2 = rnd(rng, 4, 3), rnd(rng, 4, 3, 9)
    y = g.output(ops.inv_row_norm(x))
    loss = ops.sum(y * g.const("r1", r1)) + ops.sum(x * g.const("r2", r2))
    grads = accumulate_grads(backward(loss, [x]))
    got, dx = _run_f64(g, [y, grads[x]])
    x64 = xv.astype(np.float64)
    np.testing.assert_allclose(got, 1 / np.sqrt((x64 ** 2).sum(-1)), rtol=1e-12)
    np.testing.assert_array_equal(dx, r2)   # only the direct path: the norm is detached


def test_dora_layer_gradients_treat_the_norm_as_a_constant():
    """d loss / d (A, B, m) of y = (x W^T + s x A^T B^T) * m / ||W + s B A||_row against f64
    central differences of the same function with the norm held at its value (PEFT's
    ``weight_norm.detach()``), written in numpy."""
    from toygraph.core.autodiff import accumulate_grads, backward
    rng = np.random.default_rng(5)
    s, n, d_in, d_out, r = 1.5, 6, 10, 7, 3
    xv, wv = rnd(rng, n, d_in), rnd(rng, d_out, d_in)
    av, bv, mv = rnd(rng, r, d_in), rnd(rng, d_out, r, s=0.5), 1 + rnd(rng, d_out, s=0.3)
    rv = rnd(rng, n, d_out)
    g = Graph()
    x, w = g.const("x", xv), g.const("w", wv)
    a, b, m = g.param("a", av), g.param("b", bv), g.param("m", mv)
    low = ops.scale(ops.matmul(ops.matmul(x, a, trans_b=True), b, trans_b=True), s)
    y = (ops.matmul(x, w, trans_b=True) + low) * (m * ops.inv_row_norm(w + ops.scale(ops.matmul(b, a), s)))
    loss = g.output(ops.sum(y * g.const("r", rv)))
    grads = accumulate_grads(backward(loss, [a, b, m]))
    analytic = _run_f64(g, [grads[a], grads[b], grads[m]])

    x64, w64, r64 = (v.astype(np.float64) for v in (xv, wv, rv))
    frozen = np.linalg.norm(w64 + s * bv.astype(np.float64) @ av.astype(np.float64), axis=1)

    def f(a_, b_, m_):
        out = (x64 @ w64.T + s * (x64 @ a_.T) @ b_.T) * (m_ / frozen)
        return float((out * r64).sum())

    values = [av.astype(np.float64), bv.astype(np.float64), mv.astype(np.float64)]
    for k, grad in enumerate(analytic):
        numeric = np.zeros_like(values[k])
        for i in np.ndindex(values[k].shape):
            for sign in (1, -1):
                pert = [v.copy() for v in values]
                pert[k][i] += sign * 1e-6
                numeric[i] += sign * f(*pert) / 2e-6
        assert np.abs(grad - numeric).max() / np.abs(numeric).max() <= TOL, k


# --- the weight in the norm's kernel -------------------------------------------------------
@pytest.mark.parametrize("xs,ws", [((4, 9), (9,)), ((2, 3, 4, 5), (5,)), ((3, 7), (3, 7))])
def test_weighted_norm_gradients_f64(xs, ws):
    """x and a trainable weight: [D] (the models'), per head, and one of x's shape (what the
    weight's own gradient computes with)."""
    rng = np.random.default_rng(11)
    g = Graph()
    x, w = g.param("x", rnd(rng, *xs)), g.param("w", 1 + rnd(rng, *ws, s=0.3))
    y = ops.rms_norm(x, 1e-5, weight=w)
    assert check_gradients(g, weighted_sum(y, rng), [x, w], {}) <= TOL


def test_a_weight_of_another_shape_is_an_error_naming_the_op():
    from toygraph.errors import GraphError
    g = Graph()
    x = g.const("x", np.zeros((4, 9), np.float32))
    with pytest.raises(GraphError, match="rms_norm.*weight must be \\[9\\]"):
        ops.rms_norm(x, 1e-5, weight=g.const("w", np.ones((1, 9), np.float32)))


# --- the residual stream's gradient folded into rms_norm_back ---------------------------------
def _residual_block(h, f, w, fused=False):
    """s = h + f; out = s + rms_norm(s) * w: s's gradient has two contributions, the
    residual's and the norm's backward, which autodiff sums inside rms_norm_back. ``fused``:
    the weight in the norm's kernel."""
    s = ops.add(h, f)
    normed = ops.rms_norm(s, 1e-5, weight=w) if fused else ops.mul(ops.rms_norm(s, 1e-5), w)
    return ops.add(s, normed)


@pytest.mark.parametrize("fused", [False, True])
def test_residual_norm_gradient_f64(fused):
    rng = np.random.default_rng(40)
    g = Graph()
    h, f, w = g.param("h", rnd(rng, 3, 70)), g.param("f", rnd(rng, 3, 70)), g.param("w", rnd(rng, 70))
    loss = weighted_sum(_residual_block(h, f, w, fused), rng)
    assert check_gradients(g, loss, [h, f, w], {}) <= TOL


def _folded_run(backend, fold: bool, monkeypatch):
    import dataclasses
    from support.hostparity import op_case, run_phase
    spec = ops.OPS["rms_norm_back"]
    monkeypatch.setitem(ops.OPS, "rms_norm_back",
                        spec if fold else dataclasses.replace(spec, fold_add=None))
    g, extra, fetch = op_case(_residual_block, [(5, 300), (5, 300), (300,)])
    backs = [t for t in g.nodes if t.op == "rms_norm_back"]
    adds_of_grads = [t for t in g.nodes if t.op == "add" and any(s in backs for s in t.srcs)]
    assert (len(backs[-1].srcs), len(adds_of_grads)) == ((3, 0) if fold else (2, 1))
    return run_phase(g, backend, extra, "backward", fetch)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_the_folded_add_changes_no_bit(backend, monkeypatch):
    """rms_norm_back with the residual's gradient added in its kernel gives the very bits of
    rms_norm_back then an add (numpy, and the CUDA kernels on the host executor)."""
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    folded = _folded_run(backend, True, monkeypatch)
    plain = _folded_run(backend, False, monkeypatch)
    assert all(np.array_equal(a, b) for a, b in zip(folded, plain))


def test_folded_cuda_matches_numpy(monkeypatch):
    from support.hostparity import REDUCTION, rel_err
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    got, want = _folded_run("cuda", True, monkeypatch), _folded_run("cpu", True, monkeypatch)
    assert all(rel_err(a, b) <= REDUCTION for a, b in zip(got, want))


def test_a_broken_add_index_fails_the_parity_check(monkeypatch):
    from support.hostparity import break_kernel, rel_err
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    want = _folded_run("cpu", True, monkeypatch)
    break_kernel(monkeypatch, "add[at + j]", "add[at + (j + 1) % D]")
    got = _folded_run("cuda", True, monkeypatch)
    assert not all(rel_err(a, b) <= 1e-3 for a, b in zip(got, want))


#: (x, weight) shapes: a model's rows (a row longer than a block's threads) and per-head
#: q/k norms; the residual case adds the stream's gradient in rms_norm_back.
WEIGHTED = {"rows": ((5, 300), (300,)), "per-head": ((2, 3, 4, 40), (40,))}


def _weighted_pair(fused: bool, case: str, trainable: bool, residual: bool, seed=0):
    """rms_norm(x) * w fused or as a norm then a mul, loss sum(y * r): the graph and its
    fetch list [y, d x, (d w)] (w a param, or a frozen const as LoRA keeps it)."""
    from support.hostparity import rnd as hrnd
    rng = np.random.default_rng(seed)
    xs, ws = WEIGHTED[case]
    g = Graph()
    x = g.param("x", hrnd(rng, *xs))
    w = (g.param if trainable else g.const)("w", 1 + hrnd(rng, *ws, s=0.3))
    if residual:
        y = _residual_block(x, g.const("f", hrnd(rng, *xs)), w, fused)
    elif fused:
        y = ops.rms_norm(x, 1e-5, weight=w)
    else:
        y = ops.mul(ops.rms_norm(x, 1e-5), w)
    y = g.output(y)
    loss = ops.sum(ops.mul(y, g.const("r", hrnd(rng, *y.shape))))
    params = [x, w] if trainable else [x]
    grads = accumulate_grads(backward(loss, params))
    return g, [y] + [grads[t] for t in params]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("case", sorted(WEIGHTED))
@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_the_weighted_norm_is_bit_identical_to_norm_then_mul(backend, case, trainable, residual,
                                                              monkeypatch):
    """Forward, d x (with the residual's gradient folded in) and d w, numpy and the CUDA
    kernels on the host executor."""
    from support.hostparity import run_phase
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    fused_g, fused_f = _weighted_pair(True, case, trainable, residual)
    plain_g, plain_f = _weighted_pair(False, case, trainable, residual)
    assert not any(t.op == "mul" and "w" in (s.name for s in t.srcs) for t in fused_g.nodes)
    back = [t for t in fused_g.nodes if t.op == "rms_norm_back"][-1]   # the folded one
    assert len(back.srcs) == (4 if residual else 3) and back.attrs["weighted"]
    got = run_phase(fused_g, backend, {}, "backward", fused_f)
    want = run_phase(plain_g, backend, {}, "backward", plain_f)
    for name, a, b in zip(("y", "d x", "d w"), got, want):
        assert np.array_equal(a, b), (name, float(np.abs(a - b).max()))


#: One index of the weighted norm's kernels changed: the parity check must then fail.
WEIGHT_MUTATIONS = {
    "the forward reads the next column's weight": (
        "tg_ldx(w, (long long)row * wstride + j, bf16, 1)",
        "tg_ldx(w, (long long)row * wstride + (j ^ 1), bf16, 1)"),
    "the backward multiplies g by the next column's weight": (
        "w[(long long)row * wstride + j]", "w[(long long)row * wstride + (j ^ 1)]"),
}


@pytest.mark.parametrize("mutation", one_by_default(WEIGHT_MUTATIONS))
def test_a_broken_weight_index_fails_the_parity_check(mutation, monkeypatch):
    from support.hostparity import break_kernel, rel_err, run_phase
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    g, fetch = _weighted_pair(True, "rows", True, False)
    want = run_phase(g, "cpu", {}, "backward", fetch)
    break_kernel(monkeypatch, *WEIGHT_MUTATIONS[mutation])
    got = run_phase(g, "cuda", {}, "backward", fetch)
    assert max(rel_err(a, b) for a, b in zip(got, want)) > 1e-3


# --- the models: every norm weight read inside its norm's kernels ------------------------------
def check_norm_weights_in_their_norms(path):
    """Model ``path`` built with trainable weights (full fine-tuning: the norm weights get
    gradients too): every ``*norm.weight`` is read by rms_norm (forward, and its gradient's
    g (x r)) and rms_norm_back only, never by a mul."""
    from toygraph.models.decoder import WeightSource, build_decoder
    from toygraph.models.model import GGUFModel
    model = GGUFModel(path)
    g = Graph()
    net = build_decoder(g, model.config, WeightSource(model, "finetune"), batch=1, seq_len=4)
    weights = [t for name, t in net.weights.items() if name.endswith("norm.weight")]
    backward(ops.sum(net.logits), weights)
    readers = {(t.op, i) for w in weights for t in g.nodes for i, s in enumerate(t.srcs) if s is w}
    assert weights and readers == {("rms_norm", 1), ("rms_norm_back", 2)}, readers


def test_llama_and_gemma3_norm_weights_are_in_their_norms(tiny_llama, tmp_path):
    from toygraph.fixtures.tiny_models import write_tiny_gemma3
    check_norm_weights_in_their_norms(tiny_llama)
    check_norm_weights_in_their_norms(write_tiny_gemma3(tmp_path / "gemma3.gguf"))  # q/k, post
