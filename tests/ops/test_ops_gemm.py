"""matmul and matmul_add (ops/gemm/), f32 and block-format weights.

matmul: f64 finite-difference gradients (batched, broadcast, transposed, grouped-query), and
the CUDA launches replayed in numpy: tg_matmul's batch walks, and the fused kernels that
read a weight (or a get_rows table) in each GGUF block format against numpy on the
dequantized weight. (The tensor-core kernels: test_cuda_tc_matmul.py for tc_matmul.cu,
test_cuda_tc_gemm.py for tc_gemm.cu.)

matmul_add: add + alpha * (a @ b), the product with an epilogue. LoRA's
y = x W^T + s (x A^T) B^T is one (the adapter's product adds the base output and its scale
in its epilogue), and autodiff folds a gradient's contributions into one (dx = dy W + du A;
q, k and v's shared input). What is held: the same bits as the unfused matmul, scale and
add on numpy and on the CUDA backend (host executor) at f32 and bf16, at both epilogue
sites (tc_gemm.cu's store, its split sum) and the fallback kernel; f64 finite differences;
the graph LoRA builds (no scale or add node left on the adapter's path); a broken epilogue
index failing."""
import numpy as np
import pytest

from support.cudaemu import (BLOCK_FORMATS, block_weight_const, check_lowering, const_node,
                     emulate_quant, needs_nvrtc)
from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from support.hostparity import MIXED_TOL, compare_op, rel_err, run_phase
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.ops.gemm import cuda as gemm
from toygraph.ops.gemm import cuda_tc as tc_gemm
from toygraph.gguf import blocks
from toygraph.ops.lowering import dispatch
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS
from toygraph.ops.lowering.sources import module_source
from toygraph.core.graph import Graph, topo_order
from toygraph.core.session import Session
from toygraph.ops import KERNELS as CPU_KERNELS
from support.ptxas import ARCHS  # noqa: E402
from support.tiers import one_by_default


@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((3, 4), (4, 5), False, False), ((3, 4), (5, 4), False, True),
    ((4, 3), (4, 5), True, False), ((4, 3), (5, 4), True, True),
    ((2, 3, 4), (4, 5), False, False), ((2, 3, 4), (5, 4), False, True),
    ((2, 3, 3, 4), (2, 3, 4, 5), False, False),          # batched heads
    ((2, 6, 3, 4), (2, 2, 3, 4), False, True),           # grouped-query: 6 q heads, 2 kv
    ((2, 6, 3, 3), (2, 2, 3, 4), False, False),          # attention-weights @ V, grouped
])
def test_matmul_gradients(sa, sb, ta, tb):
    rng = np.random.default_rng(3)
    g = Graph()
    a, b = g.param("a", rnd(rng, *sa)), g.param("b", rnd(rng, *sb))
    y = ops.matmul(a, b, trans_a=ta, trans_b=tb)
    assert check_gradients(g, weighted_sum(y, rng), [a, b], {}) <= TOL


def test_grouped_matmul_matches_repeated_heads():
    rng = np.random.default_rng(4)
    q, k = rnd(rng, 2, 6, 3, 4), rnd(rng, 2, 2, 3, 4)
    g = Graph()
    y = g.output(ops.matmul(g.const("q", q), g.const("k", k), trans_b=True))
    s = Session(g); s.realize(); s.run("forward")
    ref = q @ np.repeat(k, 3, axis=1).swapaxes(-1, -2)
    np.testing.assert_allclose(s.download(y), ref, rtol=1e-6)


@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((3, 4), (4, 5), False, False), ((3, 4), (5, 4), False, True),
    ((4, 3), (4, 5), True, False), ((4, 3), (5, 4), True, True),
    ((2, 3, 4), (4, 5), False, False), ((2, 3, 4), (5, 4), False, True),
    ((2, 3, 3, 4), (2, 3, 4, 5), False, False),
    ((2, 6, 3, 4), (2, 2, 3, 4), False, True),
    ((2, 6, 3, 3), (2, 2, 3, 4), False, False),
    ((2, 6, 4, 3), (2, 2, 4, 5), True, False),
    ((1, 3, 4), (2, 4, 5), False, False),
    ((2, 8, 3, 4), (1, 2, 4, 5), False, False),
])
def test_lowering_matmul_batches_match_numpy(sa, sb, ta, tb):
    node, vals = const_node(lambda a, b: ops.matmul(a, b, trans_a=ta, trans_b=tb), sa, sb)
    check_lowering(node, vals)


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_matmul_kernels_compile_for_every_format(arch, cache):
    from toygraph.cuda.nvrtc import compile_cubin
    cubin = compile_cubin(module_source(("matmul.cu", "dequant.cu", "qmatmul.cu", "rows.cu")),
                          arch=arch,
                          name="qmatmul.cu")
    assert cubin[:4] == b"\x7fELF"
    for pattern in ("tg_deq_<fmt>", "tg_qmm_nt_<fmt>", "tg_qmm_nn_<fmt>", "tg_get_rows_<fmt>"):
        assert set(FORMAT_KERNELS[pattern]) == set(BLOCK_FORMATS)
        for name in FORMAT_KERNELS[pattern].values():
            assert name.encode() in cubin, name


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("build", ["forward", "backward", "forward3d", "get_rows"])
def test_quantized_lowering_matches_numpy_on_the_dequantized_weight(fmt, build):
    rng = np.random.default_rng(7)
    g, w, raw, wv = block_weight_const(rng, fmt, 67, 512)
    rows, cols = w.shape
    if build == "forward":
        xv = rng.normal(size=(70, cols))
        node = ops.matmul(g.const("x", xv), w, trans_b=True)
    elif build == "forward3d":   # [B, T, K] @ W^T: batch axes fold into M
        xv = rng.normal(size=(2, 35, cols))
        node = ops.matmul(g.const("x", xv), w, trans_b=True)
    elif build == "backward":    # dX = dY @ W
        xv = rng.normal(size=(2, 33, rows))
        node = ops.matmul(g.const("x", xv), w)
    else:
        xv = rng.integers(0, rows, size=(3, 11)).astype(np.int32)
        node = ops.get_rows(w, g.input("ids", (3, 11), "i32"))
    x = node.srcs[1] if build == "get_rows" else node.srcs[0]
    addr = {w.id: 1 << 24, x.id: 2 << 24, node.id: 3 << 24}
    mem = {addr[w.id]: blocks.as_bytes(raw), addr[x.id]: np.asarray(xv).ravel(),
           addr[node.id]: np.zeros(node.size)}
    launches = dispatch.lower(node, lambda t: addr[t.id], raw_consts={w.id})
    pattern = {"forward": "tg_qmm_nt_<fmt>", "forward3d": "tg_qmm_nt_<fmt>",
               "backward": "tg_qmm_nn_<fmt>", "get_rows": "tg_get_rows_<fmt>"}[build]
    assert [l.kernel for l in launches] == [FORMAT_KERNELS[pattern][fmt]]
    for launch in launches:
        assert all(isinstance(v, np.ndarray) and v.dtype in (np.int32, np.uint64)
                   for v in launch.args)
        M = int(launch.args[3][0]) if build != "get_rows" else 0
        assert launch.grid[1] == max(1, (M + 63) // 64) or build == "get_rows"
        emulate_quant(launch, mem, rows)
    want = np.zeros(node.shape)
    srcs = [wv.astype(np.float64), xv] if build == "get_rows" else [xv, wv.astype(np.float64)]
    CPU_KERNELS[node.op](want, srcs, node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)


# --- matmul_add: the product with an epilogue ---------------------------------------------
@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def _pair(fused: bool, sa, sb, tb, alpha, seed=0):
    """add + alpha * a @ b (fused, or as matmul, scale, add), loss sum(y * r): the graph and
    its fetch list [y, d a, d b, d add]."""
    rng = np.random.default_rng(seed)
    g = Graph()
    a, b = g.param("a", rnd(rng, *sa)), g.param("b", rnd(rng, *sb))
    prod_shape = ops.matmul(a, b, trans_b=tb).shape
    add = g.param("add", rnd(rng, *prod_shape))
    if fused:
        y = ops.matmul_add(add, a, b, alpha=alpha, trans_b=tb)
    else:
        y = ops.add(add, ops.scale(ops.matmul(a, b, trans_b=tb), alpha))
    y = g.output(y)
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, *y.shape))))
    grads = accumulate_grads(backward(loss, [a, b, add]))
    return g, [y, grads[a], grads[b], grads[add]]


# (a, b, trans_b): a LoRA up-projection (k = rank), a square product, a long-k one that
# the bf16 GEMM splits (the epilogue then runs in the split sum)
CASES = {"lora-up": ((300, 16), (70, 16), True),
         "square": ((130, 150), (150, 140), False),
         "split-k": ((24, 1100), (1100, 20), False)}


def copies_always(monkeypatch):
    """Every dense bf16 product through tc_gemm.cu (the cost model picks it only for
    products too large to run quickly on the host executor)."""
    monkeypatch.setattr(gemm, "prefers_copies", lambda *a, **k: True)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend,precision,copies", [
    ("cpu", "f32", False), ("cuda", "f32", False), ("cuda", "bf16", False),
    ("cuda", "bf16", True)])
def test_fused_is_bit_identical_to_matmul_scale_add(case, backend, precision, copies,
                                                      monkeypatch):
    """Forward and every gradient; ``copies``: the epilogue in tc_gemm.cu's store (or, for
    split-k, its split sum) rather than in tg_matmul_add_epilogue."""
    if copies:
        copies_always(monkeypatch)
    sa, sb, tb = CASES[case]
    fused_g, fused_f = _pair(True, sa, sb, tb, 0.37)
    plain_g, plain_f = _pair(False, sa, sb, tb, 0.37)
    got = run_phase(fused_g, backend, {}, "backward", fused_f, precision)
    want = run_phase(plain_g, backend, {}, "backward", plain_f, precision)
    for name, x, y in zip(("y", "d a", "d b", "d add"), got, want):
        assert np.array_equal(x, y), (name, float(np.abs(x - y).max()))


#: (a, b, trans_b) -> where the bf16 lowering runs the epilogue
ROUTES = {((4096, 16), (576, 16), True): "tg_tcg_gemm_bf16",    # SmolLM2's LoRA up, 8 x 512
          ((24, 1100), (1100, 20), False): "tg_tcg_sum_splits",  # long k: split, then summed
          ((300, 16), (70, 16), True): "tg_matmul_add_epilogue"}  # too small for the copies


@pytest.mark.parametrize("shapes", list(ROUTES))
def test_the_bf16_lowering_runs_the_epilogue_where_the_cost_model_says(shapes):
    sa, sb, tb = shapes
    ptr = lambda t: (t.id + 1) << 30   # noqa: E731
    g = Graph()
    a, b = g.const("a", np.zeros(sa, np.float32)), g.const("b", np.zeros(sb, np.float32))
    c = g.const("c", np.zeros(ops.matmul(a, b, trans_b=tb).shape, np.float32))
    node = ops.matmul_add(c, a, b, alpha=2.0, trans_b=tb)
    launches = dispatch.lower(node, ptr, 1 << 40, precision="bf16")
    last = launches[-1]
    assert last.kernel == ROUTES[shapes]
    add_at = 1 if last.kernel == "tg_matmul_add_epilogue" else -3
    assert int(last.args[add_at][0]) == ptr(c)
    assert sum("epilogue" in l.kernel for l in launches) == (add_at == 1)
    f32 = [l.kernel for l in dispatch.lower(node, ptr, 1 << 40, precision="f32")]
    assert f32 == ["tg_matmul", "tg_matmul_add_epilogue"]


def test_the_cost_model_counts_the_epilogue_pass_of_the_direct_kernel():
    """A skinny product (LoRA's up-projection, k = rank) that alone would run the direct
    kernel runs the bf16 GEMM once the add's extra pass is counted."""
    g = Graph()
    node = ops.matmul(g.const("u", np.zeros((4096, 16), np.float32)),
                      g.const("b", np.zeros((576, 16), np.float32)), trans_b=True)
    shape = gemm.matmul_gemm(node)
    assert not tc_gemm.prefers_copies(shape)
    assert tc_gemm.prefers_copies(shape, epilogue=True)


def test_gradients_match_finite_differences_in_f64():
    rng = np.random.default_rng(3)
    g = Graph()
    a, b = g.param("a", rnd(rng, 5, 4)), g.param("b", rnd(rng, 6, 4))
    add = g.param("add", rnd(rng, 5, 6))
    y = ops.matmul_add(add, a, b, alpha=-0.6, trans_b=True)
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, 5, 6))))
    assert check_gradients(g, loss, [a, b, add], {}) <= TOL


@pytest.mark.parametrize("sa,sb,tb,out", [((2, 7, 5), (5, 3), False, (2, 7, 3)),
                                         ((3, 9), (4, 9), True, (3, 4))])
def test_host_executor_matches_numpy_at_bf16(sa, sb, tb, out):
    def build(a, b, c):
        return ops.matmul_add(c, a, b, alpha=0.5, trans_b=tb)
    compare_op(build, [sa, sb, out], MIXED_TOL["bf16"], grad_tol=MIXED_TOL["bf16"],
               precision="bf16")


def test_autodiff_folds_a_shared_inputs_contributions_into_the_products():
    """x feeding three products (q, k, v): its gradient is matmul_add chained, no add node."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.param("x", rnd(rng, 6, 8))
    ys = [ops.matmul(x, g.const(f"w{i}", rnd(rng, 5, 8)), trans_b=True) for i in range(3)]
    loss = ops.sum(ops.mul(ops.add(ops.add(ys[0], ys[1]), ys[2]), g.const("r", rnd(rng, 6, 5))))
    dx = backward(loss, [x])[x]
    chain = [t.op for t in topo_order([dx]) if t.op in ("add", "matmul", "matmul_add")]
    assert dx.op == "matmul_add" and "add" not in chain[-3:], chain
    assert chain[-3:] == ["matmul", "matmul_add", "matmul_add"], chain


def test_lora_projection_has_no_scale_or_add_on_the_adapters_path(tiny_llama):
    from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder
    from toygraph.models.model import GGUFModel
    cfg = GGUFModel(tiny_llama).config
    net = build_decoder(Graph(), cfg, WeightSource(mode="scratch"), batch=1, seq_len=4,
                        lora=LoraConfig(rank=2, alpha=4, targets=("q", "v")))
    order = topo_order([net.logits])
    fused = [t for t in order if t.op == "matmul_add"]
    assert len(fused) == 2 * cfg.n_layer
    assert not any(t.op == "scale" and t.srcs[0].op == "matmul" for t in order)
    for t in fused:
        _, u, b = t.srcs
        assert u.op == "matmul" and b.role == "param" and t.attrs["alpha"] == 2.0


#: One index of the epilogue changed: the fused result then differs from the unfused one.
MUTATIONS = {
    "store adds the wrong row of add": ("__fadd_rn(tg_ldx(add, o, bf16, 0),",
                                        "__fadd_rn(tg_ldx(add, o ^ 1, bf16, 0),"),
    "split sum adds its neighbour's add": ("add ? __fadd_rn(tg_ldx(add, i, bf16, 0),",
                                           "add ? __fadd_rn(tg_ldx(add, i ^ 1, bf16, 0),"),
}


@pytest.mark.parametrize("mutation", one_by_default(MUTATIONS))
def test_a_broken_epilogue_index_fails(mutation, monkeypatch):
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    old, new = MUTATIONS[mutation]
    real = sources.backend_source("bf16")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    copies_always(monkeypatch)
    case = CASES["split-k" if "split" in mutation else "square"]
    fused_g, fused_f = _pair(True, *case, 0.37)
    plain_g, plain_f = _pair(False, *case, 0.37)
    want = run_phase(plain_g, "cuda", {}, "backward", plain_f, "bf16")
    monkeypatch.setattr(cuda_backend, "backend_source",
                        lambda precision="bf16": real.replace(old, new))
    got = run_phase(fused_g, "cuda", {}, "backward", fused_f, "bf16")
    assert not np.array_equal(got[0], want[0])


# --- scale_a: (s a) @ b with the scale applied where the product reads a -------------------
def _scaled_pair(fused: bool, sa, sb, ta, tb, s, seed=0):
    """(s a) @ b, as matmul(scale_a=s) or as scale then matmul; loss sum(y * r)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    a, b = g.param("a", rnd(rng, *sa)), g.param("b", rnd(rng, *sb))
    if fused:
        y = ops.matmul(a, b, trans_a=ta, trans_b=tb, scale_a=s)
    else:
        y = ops.matmul(ops.scale(a, s), b, trans_a=ta, trans_b=tb)
    y = g.output(y)
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, *y.shape))))
    grads = accumulate_grads(backward(loss, [a, b]))
    return g, [y, grads[a], grads[b]]


#: (a, b, trans_a, trans_b): LoRA's dB (dy^T u, a read transposed), du (dy B), a batched
#: product with a weight shared by the batch, a long-k one the bf16 GEMM splits
SCALED = {"lora-dB": ((300, 70), (300, 16), True, False),
          "lora-du": ((300, 70), (70, 16), False, False),
          "batched": ((2, 40, 24), (30, 24), False, True),
          "split-k": ((1100, 24), (1100, 20), True, False)}


@pytest.mark.parametrize("case", sorted(SCALED))
@pytest.mark.parametrize("backend,precision,copies", [
    ("cpu", "f32", False), ("cuda", "f32", False), ("cuda", "bf16", False),
    ("cuda", "bf16", True)])
def test_scale_a_is_bit_identical_to_a_scale_node(case, backend, precision, copies,
                                                  monkeypatch):
    """The product's own scale (the direct kernels' prescale into scratch, the bf16 copy's
    __fmul_rn) rounds as the scale node it replaces, forward and backward."""
    if copies:
        copies_always(monkeypatch)
    sa, sb, ta, tb = SCALED[case]
    fused_g, fused_f = _scaled_pair(True, sa, sb, ta, tb, -0.37)
    plain_g, plain_f = _scaled_pair(False, sa, sb, ta, tb, -0.37)
    got = run_phase(fused_g, backend, {}, "backward", fused_f, precision)
    want = run_phase(plain_g, backend, {}, "backward", plain_f, precision)
    for name, x, y in zip(("y", "d a", "d b"), got, want):
        assert np.array_equal(x, y), (name, float(np.abs(x - y).max()))


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_scale_a_gradients_match_finite_differences_in_f64(ta, tb):
    rng = np.random.default_rng(4)
    g = Graph()
    a = g.param("a", rnd(rng, *((4, 5) if ta else (5, 4))))
    b = g.param("b", rnd(rng, *((6, 4) if tb else (4, 6))))
    add = g.param("add", rnd(rng, 5, 6))
    y = ops.matmul_add(add, a, b, alpha=0.7, trans_a=ta, trans_b=tb, scale_a=-1.3)
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, 5, 6))))
    assert check_gradients(g, loss, [a, b, add], {}) <= TOL


def test_lora_backward_reads_the_scaled_gradient_without_a_scale_pass(tiny_llama):
    """A LoRA projection's dB and du read s dy through scale_a: the backward has no scale
    node over the output gradient of a LoRA up-projection."""
    from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder
    from toygraph.models.model import GGUFModel
    cfg = GGUFModel(tiny_llama).config
    g = Graph()
    net = build_decoder(g, cfg, WeightSource(mode="scratch"), batch=1, seq_len=4,
                        lora=LoraConfig(rank=2, alpha=4, targets=("q", "v")))
    params = [t for t in topo_order([net.logits]) if t.role == "param"]
    loss = ops.sum(net.logits)
    grads = backward(loss, params)
    order = topo_order(list(grads.values()))
    scaled = [t for t in order if t.op == "matmul" and t.attrs.get("scale_a", 1.0) != 1.0]
    assert len(scaled) == 2 * 2 * cfg.n_layer      # dB and du of every adapter
    assert all(t.attrs["scale_a"] == 2.0 for t in scaled)
    assert not any(t.op == "scale" and t.attrs["s"] == 2.0 for t in order)


def test_the_cost_model_counts_the_prescale_pass_of_the_direct_kernel():
    g = Graph()
    node = ops.matmul(g.const("dy", np.zeros((4096, 576), np.float32)),
                      g.const("u", np.zeros((4096, 16), np.float32)), trans_a=True)
    shape = gemm.matmul_gemm(node)
    assert (tc_gemm.prefers_copies(shape, scaled_a=True)
            or not tc_gemm.prefers_copies(shape))      # never the worse pick for the scale
    direct_only = ops.matmul(g.const("x", np.zeros((64, 16), np.float32)),
                             g.const("w", np.zeros((16, 8), np.float32)), scale_a=3.0)
    assert [l.kernel for l in dispatch.lower(direct_only, lambda t: (t.id + 1) << 30, 1 << 40)
            ] == ["tg_scale_vec", "tg_matmul"]


# --- the dual GEMM: a LoRA projection's base product absorbed by its adapter's -------------------
def _lora_projection(w_format: str | None, seed=0, rows=200, out=80, rank=8):
    """y = x W^T + s (x A^T) B^T with W f32 (``w_format`` None, a param) or a frozen
    block-format const, loss sum(y * r): graph, fetch [y, dx, dA, dB (, dW)]."""
    from support.cudaemu import qweight
    rng = np.random.default_rng(seed)
    cols = 96 if w_format in (None, "q8_0") else 256     # whole blocks of the format
    g = Graph()
    x = g.param("x", rnd(rng, rows, cols))
    if w_format is None:
        w = g.param("w", rnd(rng, out, cols, s=0.2))
    else:
        raw, _ = qweight(rng, w_format, out, cols)
        w = g.const("w", raw, shape=(out, cols), storage=w_format)
    a, b = g.param("a", rnd(rng, rank, cols, s=0.3)), g.param("b", rnd(rng, out, rank, s=0.3))
    u = ops.matmul(x, a, trans_b=True)
    y = g.output(ops.matmul_add(ops.matmul(x, w, trans_b=True), u, b, alpha=1.7, trans_b=True))
    loss = ops.sum(ops.mul(y, g.const("r", rnd(rng, rows, out))))
    params = [x, a, b] + ([w] if w_format is None else [])
    grads = accumulate_grads(backward(loss, params))
    return g, [y] + [grads[p] for p in params]


@pytest.mark.parametrize("w_format", [None, "q4_k", "q8_0"])
def test_the_dual_gemm_tracks_numpy_and_the_two_gemms(w_format, monkeypatch):
    from support.cudaemu import training_plan
    from toygraph.cuda.bf16_storage import plan_storage
    g, fetch = _lora_projection(w_format)
    order, pinned, _, _ = training_plan(g)
    assert plan_storage(order, pinned, "bf16").absorbed       # the forward's base at least
    dual = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    g2, fetch2 = _lora_projection(w_format)
    want = run_phase(g2, "cpu", {}, "backward", fetch2)
    monkeypatch.setenv("TOYGRAPH_CUDA_DUAL_GEMM", "0")
    g3, fetch3 = _lora_projection(w_format)
    two = run_phase(g3, "cuda", {}, "backward", fetch3, "bf16")
    for name, d, w, t in zip(("y", "dx", "dA", "dB", "dW"), dual, want, two):
        assert rel_err(d, w) <= MIXED_TOL["bf16"], (name, rel_err(d, w))
        assert rel_err(d, t) <= MIXED_TOL["bf16"], (name, rel_err(d, t))


DUAL_MUTATIONS = {
    "the second product's slices start one slice late":
        ("(kt - two.ktiles1) * TCG_BK, two.kp);\\n        tcg_issue(Bs",
         "(kt - two.ktiles1 + 1) * TCG_BK, two.kp);\\n        tcg_issue(Bs"),
    "the second product is skipped": ("+ (DUAL ? (two.kp + TCG_BK - 1) / TCG_BK : 0);",
                                      "+ 0;"),
}


@pytest.mark.parametrize("mutation", one_by_default(DUAL_MUTATIONS))
def test_a_broken_dual_gemm_fails(mutation, monkeypatch):
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    old, new = (x.replace("\\n", "\n") for x in DUAL_MUTATIONS[mutation])
    real = sources.backend_source("bf16")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    g, fetch = _lora_projection(None)
    want = run_phase(g, "cpu", {}, "backward", fetch)
    monkeypatch.setattr(cuda_backend, "backend_source",
                        lambda precision="bf16": real.replace(old, new))
    g2, fetch2 = _lora_projection(None)
    got = run_phase(g2, "cuda", {}, "backward", fetch2, "bf16")
    assert rel_err(got[0], want[0]) > 5 * MIXED_TOL["bf16"]
