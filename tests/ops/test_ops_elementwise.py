"""The elementwise ops (ops/elementwise/: add, sub, mul, scale, silu, gelu, and the
swiglu/geglu/mean composites): f64 finite-difference gradients, GELU against torch's tanh
approximation, and their CUDA launches replayed in numpy against the numpy kernels."""
import numpy as np
import pytest

from support.cudaemu import check_lowering, const_node
from support.gradcheck import TOL, check_gradients, forward_f64, gradcheck_unary, rnd, weighted_sum
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.ops.lowering import dispatch
from support.kernelsrc import KERNEL_NAMES
from support.kernelsrc import OP_KERNELS
from support.tiers import one_by_default
from toygraph.core.graph import Graph


@pytest.mark.parametrize("name,build,shape", [
    ("scale", lambda x: ops.scale(x, -1.7), (3, 4)),
    ("silu", ops.silu, (3, 5)),
    ("softcap", lambda x: ops.softcap(ops.scale(x, 20.0), 15.0), (3, 5)),
    ("mean_axis", lambda x: ops.mean(x, -1), (3, 4)),
])
def test_unary_gradients(name, build, shape):
    assert gradcheck_unary(build, shape) <= TOL


@pytest.mark.parametrize("op,sa,sb", [
    (ops.add, (3, 4), (3, 4)), (ops.add, (2, 3, 4), (4,)),
    (ops.sub, (3, 4), (1, 4)), (ops.mul, (3, 4), (3, 4)), (ops.mul, (2, 3, 4), (3, 1)),
])
def test_binary_gradients(op, sa, sb):
    rng = np.random.default_rng(1)
    g = Graph()
    a, b = g.param("a", rnd(rng, *sa)), g.param("b", rnd(rng, *sb))
    assert check_gradients(g, weighted_sum(op(a, b), rng), [a, b], {}) <= TOL


def _oai_inputs(rng):
    """Gates and ups of scale 6: many beyond the clamp limit 2.5 on either side."""
    return rnd(rng, 5, 8, s=6.0), rnd(rng, 5, 8, s=6.0)


def test_swiglu_oai_gradient_is_zero_where_clamped():
    rng = np.random.default_rng(7)
    gv, uv = _oai_inputs(rng)
    assert (gv > 2.5).any() and (np.abs(uv) > 2.5).any() and (np.abs(uv) < 2.5).any()
    g = Graph()
    a, b = g.param("gate", gv), g.param("up", uv)
    y = ops.swiglu_oai(a, b, alpha=1.702, limit=2.5)
    assert check_gradients(g, weighted_sum(y, rng), [a, b], {}, max_elems=40) <= TOL


def test_swiglu_oai_is_transformers_gpt_oss_gate():
    """GptOssExperts._apply_gate: gate.clamp(max=limit), up.clamp(-limit, limit),
    gate * sigmoid(alpha * gate) * (up + 1) (torch, f64)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    gv, uv = _oai_inputs(rng)
    g = Graph()
    y = g.output(ops.swiglu_oai(g.const("g", gv), g.const("u", uv), alpha=1.702, limit=2.5))
    got = forward_f64(g).download(y)
    gt, ut = torch.tensor(gv, dtype=torch.float64), torch.tensor(uv, dtype=torch.float64)
    gt, ut = gt.clamp(max=2.5), ut.clamp(min=-2.5, max=2.5)
    np.testing.assert_allclose(got, (gt * torch.sigmoid(gt * 1.702) * (ut + 1)).numpy(),
                               rtol=1e-12)


def test_swiglu_gradient():
    rng = np.random.default_rng(2)
    g = Graph()
    a, b = g.param("gate", rnd(rng, 4, 6)), g.param("up", rnd(rng, 4, 6))
    assert check_gradients(g, weighted_sum(ops.swiglu(a, b), rng), [a, b], {}) <= TOL


# --- GELU (tanh approximation) --------------------------------------------------------------
def test_gelu_gradient():
    rng = np.random.default_rng(20)
    g = Graph()
    x = g.param("x", rnd(rng, 3, 7, s=2.0))
    assert check_gradients(g, weighted_sum(x.gelu(), rng), [x], {}) <= TOL


def test_geglu_gradient():
    rng = np.random.default_rng(21)
    g = Graph()
    a, b = g.param("gate", rnd(rng, 4, 6, s=2.0)), g.param("up", rnd(rng, 4, 6))
    assert check_gradients(g, weighted_sum(ops.geglu(a, b), rng), [a, b], {}) <= TOL


def test_gelu_matches_torch_tanh_approximation():
    torch = pytest.importorskip("torch")
    xv = np.concatenate([np.linspace(-12, 12, 241), [-100.0, 100.0, 0.0]])
    g = Graph()
    y = g.output(ops.gelu(g.const("x", xv)))
    want = torch.nn.functional.gelu(torch.tensor(xv), approximate="tanh").numpy()
    np.testing.assert_allclose(forward_f64(g).download(y), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("build,shapes", [
    (ops.add, [(2, 3, 4), (4,)]), (ops.sub, [(3, 4), (1, 4)]), (ops.mul, [(2, 3, 4), (3, 1)]),
    (ops.add, [(2, 1, 4), (3, 1)]), (ops.mul, [(5, 7), (5, 7)]),
])
def test_lowering_walks_match_numpy(build, shapes):
    node, vals = const_node(build, *shapes)
    check_lowering(node, vals)


# --- GELU and the per-head q/k norm ---------------------------------------------------------------
def test_gelu_launches():
    g = Graph()
    x, dy = g.const("x", np.zeros((3, 70))), g.const("dy", np.zeros((3, 70)))
    for node, kernel, n_ptr in ((ops.gelu(x), "tg_gelu", 2), (ops.gelu_back(x, dy),
                                                               "tg_gelu_back", 3)):
        (launch,) = dispatch.lower(node, lambda t: (t.id + 1) << 20)
        assert launch.kernel == kernel and kernel in KERNEL_NAMES
        assert kernel in OP_KERNELS[node.op]
        assert [v.dtype for v in launch.args] == [np.uint64] * n_ptr + [np.int32]
        assert int(launch.args[-1][0]) == 210 and launch.grid[0] * launch.block[0] >= 210


@pytest.mark.parametrize("shapes", [[(2, 3, 4, 5), (5,)], [(2, 3, 4, 5), (1, 1, 4, 1)]])
def test_four_d_broadcast_mul_lowering_matches_numpy(shapes):
    check_lowering(*const_node(ops.mul, *shapes))


def test_softcap_is_cap_times_tanh_and_refuses_a_bad_cap():
    g = Graph()
    xv = np.array([-1e4, -30.0, -1.0, 0.0, 0.5, 30.0, 1e4], np.float32)
    y = g.output(ops.softcap(g.const("x", xv), 30.0))
    from toygraph.core.session import Session
    s = Session(g)
    s.realize()
    s.run("forward")
    np.testing.assert_allclose(s.download(y), 30.0 * np.tanh(xv / 30.0), rtol=1e-6)
    from toygraph.errors import GraphError
    with pytest.raises(GraphError, match="positive cap"):
        ops.softcap(g.const("z", xv), 0.0)


# --- the vectorised kernels on the host executor ------------------------------------------------
VEC_SIZES = [(1,), (3,), (4,), (5,), (7, 129), (3, 1024 + 2)]   # quads and ragged tails


@pytest.mark.parametrize("shape", VEC_SIZES)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "scale"])
def test_vectorised_kernels_match_numpy(op, shape, monkeypatch):
    """Same-shape add/sub/mul and scale run tg_binary_vec / tg_scale_vec (float4, then the
    tail one by one): exactly numpy's f32 results, forward and backward."""
    from support.hostparity import compare_op
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    build = (lambda x: ops.scale(x, -1.7)) if op == "scale" else getattr(ops, op)
    n_srcs = 1 if op == "scale" else 2
    compare_op(build, [shape] * n_srcs, 0.0, grad_tol=0.0)


def test_same_shape_operands_take_the_vector_kernel():
    g = Graph()
    a, b = g.const("a", np.ones((3, 5))), g.const("b", np.ones((3, 5)))
    kernels = lambda t: [l.kernel for l in dispatch.lower(t, lambda s: (s.id + 1) << 20)]  # noqa: E731
    assert kernels(ops.mul(a, b)) == ["tg_binary_vec"]
    assert kernels(ops.scale(a, 2.0)) == ["tg_scale_vec"]
    assert kernels(ops.mul(a, g.const("r", np.ones(5)))) == ["tg_binary"]   # broadcast
    odd = [l.kernel for l in dispatch.lower(ops.add(a, b), lambda s: 4 + ((s.id + 1) << 20))]
    assert odd == ["tg_binary"]                                              # not 16-byte aligned


#: One index of the vector path changed as a careless edit would: parity must then fail.
VEC_MUTATIONS = {
    "the tail starts one element late": ("for (int i = 4 * n4 + blockIdx.x",
                                         "for (int i = 4 * n4 + 1 + blockIdx.x"),
    "b's quad is the next one": ("float4 y = reinterpret_cast<const float4*>(b)[i];",
                                 "float4 y = reinterpret_cast<const float4*>(b)[(i + 1) % n4];"),
}


@pytest.mark.parametrize("mutation", one_by_default(VEC_MUTATIONS))
def test_a_broken_vector_index_fails_the_parity_check(mutation, monkeypatch):
    from support.hostparity import break_kernel, op_case, rel_err, run_phase
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    g, extra, fetch = op_case(ops.add, [(3, 7), (3, 7)])
    want = run_phase(g, "cpu", extra, "forward", fetch[:1])
    break_kernel(monkeypatch, *VEC_MUTATIONS[mutation])
    got = run_phase(g, "cuda", extra, "forward", fetch[:1])
    assert not rel_err(got[0], want[0]) <= 1e-3
