"""The mixture-of-experts kernels (ops/experts/experts.cu) executed on the CPU by the host
executor (TOYGRAPH_CUDA_DEVICE=host) against the numpy kernels: top-k and the grouping
exactly, the grouped GEMMs (f32 and block-format expert weights, ragged 64-row tiles,
an unused expert) forward and backward within tests/cuda/test_cuda.py's tolerances, and a
deliberately broken index in each kernel family failing its check."""
import numpy as np
import pytest

from support.hostparity import ELEMENTWISE, REDUCTION, compare_op, op_case, rel_err, rnd, run_phase
from support.tiers import one_by_default
from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from toygraph.cuda import backend as cuda_backend
from toygraph.ops.lowering import sources
from toygraph.gguf import block_encode, blocks


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def chosen(rng, n, k, n_expert):
    """[n, k] distinct expert ids per row, expert 0 never chosen (an unused expert)."""
    return np.stack([rng.choice(np.arange(1, n_expert), k, replace=False) for _ in range(n)]
                    ).astype(np.int32)


def ids_input(n, k, n_expert):
    def make(g, rng):
        return {g.input("ids", (n, k), "i32"): chosen(rng, n, k, n_expert)}
    return make


def test_topk_take_along_and_grouping_match_numpy_exactly():
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (70, 6))
    xv = rnd(rng, 70, 6)
    xv[3, :] = 1.0                     # a row of ties: the lower index first
    ids = g.output(ops.topk(x, 3))
    taken = g.output(ops.take_along(x, ids))
    routes = g.output(ops.group_by_expert(ids, 6))
    want = run_phase(g, "cpu", {x: xv}, "forward", [ids, taken, routes])
    got = run_phase(g, "cuda", {x: xv}, "forward", [ids, taken, routes])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[0][3], [0, 1, 2])


@pytest.mark.parametrize("x_slots", [False, True])
@pytest.mark.parametrize("trans_b", [True, False])
def test_expert_matmul_and_its_gradients_match_numpy(x_slots, trans_b):
    """70 tokens x 2 slots over 5 experts: groups of ~35 rows and more than one 64-row
    tile for some, 37/70 inner and outer widths (ragged tiles), expert 0 unused."""
    N, k, E, n_in, n_out = 70, 2, 5, 37, 70
    x_shape = (N, k, n_in) if x_slots else (N, n_in)
    w_shape = (E, n_out, n_in) if trans_b else (E, n_in, n_out)

    def build(x, w, ids):
        return ops.expert_matmul(x, w, ops.group_by_expert(ids, E), trans_b=trans_b)
    compare_op(build, [x_shape, w_shape], REDUCTION, inputs_fn=ids_input(N, k, E))


def test_take_along_gradient_matches_numpy():
    compare_op(lambda x, ids: ops.take_along(x, ids), [(9, 6)], ELEMENTWISE,
               inputs_fn=ids_input(9, 2, 6))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "bf16", "q6_k", "mxfp4"])
def test_block_format_experts_stay_in_blocks_and_match_numpy(fmt):
    """Expert weights [E, out, in] kept in their block format on the device (no f32 copy),
    decoded inside the grouped GEMM: y = x W[e]^T and dx = dy W[e] against numpy on the
    dequantized weights."""
    rng = np.random.default_rng(1)
    N, k, E, n_out = 40, 2, 4, 24
    n_in = blocks.BLOCK[fmt][0]
    raw = block_encode.quantize(rnd(rng, E * n_out, n_in), fmt)
    g = Graph()
    x = g.param("x", rnd(rng, N, n_in))
    w = g.const("w", raw, shape=(E, n_out, n_in), storage=fmt)
    ids = g.input("ids", (N, k), "i32")
    y = g.output(ops.expert_matmul(x, w, ops.group_by_expert(ids, E)))
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, *y.shape))))
    grads = accumulate_grads(backward(loss, [x]))
    inputs = {ids: chosen(rng, N, k, E)}
    want = run_phase(g, "cpu", inputs, "backward", [y, grads[x]])
    s = Session(g, backend="cuda")
    s.realize()
    assert w.id in s.backend.raw_consts
    s.reset()
    s.upload(ids, inputs[ids])
    s.run("backward")
    for got, ref in zip((s.download(y), s.download(grads[x])), want):
        assert rel_err(got, ref) <= REDUCTION


def moe_block(x, router, gate, up, down, k=2):
    """A whole MoE FFN: x -> router top-k, softmax over the chosen logits -> experts."""
    E = router.shape[0]
    logits = ops.matmul(x, router, trans_b=True)
    ids = ops.topk(logits, k)
    w = ops.softmax(ops.take_along(logits, ids))
    routes = ops.group_by_expert(ids, E)
    h = ops.swiglu(ops.expert_matmul(x, gate, routes), ops.expert_matmul(x, up, routes))
    return ops.sum(ops.mul(ops.expert_matmul(h, down, routes), w.reshape(x.shape[0], k, 1)), 1)


def test_a_moe_block_trains_like_numpy():
    """Forward, d/dx (through router and experts), and every weight's gradient."""
    N, D, E, F = 33, 20, 6, 12
    compare_op(moe_block, [(N, D), (E, D), (E, F, D), (E, F, D), (E, D, F)], REDUCTION)


# --- a broken kernel must fail -----------------------------------------------------------------
MUTATIONS = {   # one index expression each, as a careless edit would change it
    "grouping counts its own expert as before it": (
        "before += ids[r] < e;", "before += ids[r] <= e;"),
    "the grouped GEMM reads the wrong token of a slot": (
        "x[(long long)(x_by_token ? slot / k : slot) * K + gk]",
        "x[(long long)(x_by_token ? slot % k : slot) * K + gk]"),
    "the weight gradient drops an expert's last slot": (
        "int lo = routes[e], K = routes[e + 1] - lo;", "int lo = routes[e], K = routes[e + 1] - lo - 1;"),
    "take_along's scatter mirrors the expert index": (
        "int r = i / E, e = i - r * E;", "int r = i / E, e = E - 1 - (i - r * E);"),
}


@pytest.mark.parametrize("mutation", one_by_default(MUTATIONS))
def test_a_broken_kernel_fails_its_parity_check(mutation, monkeypatch):
    """The module the backend compiles with one index expression changed: the parity check
    that passes on the real source must fail, so the kernel bodies really run."""
    old, new = MUTATIONS[mutation]
    real = sources.backend_source("f32")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    monkeypatch.setattr(cuda_backend, "backend_source", lambda precision="f32": real.replace(old, new))
    g, extra, fetch = op_case(moe_block, [(33, 20), (6, 20), (6, 12, 20), (6, 12, 20), (6, 20, 12)])
    want = run_phase(g, "cpu", extra, "backward", fetch)
    got = run_phase(g, "cuda", extra, "backward", fetch)
    assert not all(rel_err(a, b) <= 1e-2 for a, b in zip(got, want))   # NaN counts as wrong

