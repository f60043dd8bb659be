"""The fused gated activations (ops/gated/: glu, swiglu, geglu, glu_back): f64
finite-difference gradients, bit-identity with the composed activation-and-mul ops they
replace (numpy, and the CUDA kernels on the host executor), host-executor parity with numpy
at ragged sizes, the backward's one launch with its two results handed out as views, and a
deliberately broken index failing the parity check."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from support.hostparity import ELEMENTWISE, break_kernel, compare_op, op_case, rel_err, run_phase
from support.tiers import one_by_default
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.ops.gated import PACK_ALIGN, up_offset
from toygraph.core.session import Session
from toygraph.errors import GraphError

ACTS = {"silu": ops.silu, "gelu": ops.gelu}


@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("shape", [(4, 6), (3, 70)])   # 70 * 3: d up's start is padded
def test_gradients_f64(act, shape):
    rng = np.random.default_rng(3)
    g = Graph()
    a, b = g.param("gate", rnd(rng, *shape, s=2.0)), g.param("up", rnd(rng, *shape))
    assert check_gradients(g, weighted_sum(ops.glu(a, b, act), rng), [a, b], {}) <= TOL


def _composed(act):
    return lambda gate, up: ops.mul(ACTS[act](gate), up)


def _fused(act):
    return lambda gate, up: ops.glu(gate, up, act)


def _run(build, backend, shape=(37, 29), seed=0):
    g, extra, fetch = op_case(build, [shape, shape], seed=seed)
    return run_phase(g, backend, extra, "backward", fetch)


@pytest.mark.parametrize("act", sorted(ACTS))
def test_numpy_is_bit_identical_to_the_composed_ops(act):
    """Forward, d gate and d up: the same f32 bits as act(gate) * up built from two ops,
    which keeps every golden experiment bit-identical."""
    for got, want in zip(_run(_fused(act), "cpu"), _run(_composed(act), "cpu")):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("act", sorted(ACTS))
def test_cuda_kernels_are_bit_identical_to_the_composed_kernels(act, host_device):
    for got, want in zip(_run(_fused(act), "cuda"), _run(_composed(act), "cuda")):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (3, 65)])
def test_cuda_matches_numpy(act, shape, host_device):
    compare_op(_fused(act), [shape, shape], ELEMENTWISE, grad_tol=ELEMENTWISE)


def _backward_nodes(shape=(5, 70)):
    g, extra, fetch = op_case(_fused("silu"), [shape, shape])
    s = Session(g, backend="cpu")
    plan = s.realize()
    order = s.schedules["backward"]
    (back,) = [t for t in order if t.op == "glu_back"]
    views = [t for t in order if t.op == "unpack" and t.srcs[0] is back]
    return plan, back, views


def test_the_two_gradients_are_views_of_the_one_packed_buffer():
    plan, back, views = _backward_nodes()
    n = 5 * 70
    assert back.shape == (up_offset(n) + n,) and up_offset(n) % PACK_ALIGN == 0
    assert sorted(plan.offsets[v.id] - plan.offsets[back.id] for v in views) == \
        [0, 4 * up_offset(n)]


def test_the_backward_is_one_launch(host_device):
    """glu_back is one kernel; the unpack views launch nothing (no copies)."""
    g, extra, fetch = op_case(_fused("gelu"), [(5, 70), (5, 70)])
    s = Session(g, backend="cuda")
    s.realize()
    launches = s.backend._launches
    kernels = {t.op: [item[0] for item in launches.get(t.id, ())] for t in s.schedules["step"]
               if t.op in ("glu", "glu_back", "unpack")}
    assert {op: len(ks) for op, ks in kernels.items()} == {"glu": 1, "glu_back": 1, "unpack": 0}


def test_mismatched_shapes_are_refused():
    g = Graph()
    with pytest.raises(GraphError, match="shapes must match"):
        ops.swiglu(g.param("a", np.ones((2, 3), np.float32)), g.param("b", np.ones(3, np.float32)))


#: One index of gated.cu changed as a careless edit would: the parity check must fail.
MUTATIONS = {
    "d up is written one element early": ("tg_stx(out, (long long)up_at + i,",
                                          "tg_stx(out, (long long)up_at + i - (i > 0),"),
    "the forward reads the next up": ("tg_ldx(up, i, bf16, 1)), bf16);",
                                      "tg_ldx(up, (i + 1) % n, bf16, 1)), bf16);"),
}


@pytest.mark.parametrize("mutation", one_by_default(MUTATIONS))
def test_a_broken_index_fails_the_parity_check(mutation, host_device, monkeypatch):
    want = _run(_fused("silu"), "cpu")
    break_kernel(monkeypatch, *MUTATIONS[mutation])
    got = _run(_fused("silu"), "cuda")
    errors = [rel_err(a, b) for a, b in zip(got, want)]
    assert not all(e <= 1e-2 for e in errors), errors   # NaN (an unwritten slot) fails too
