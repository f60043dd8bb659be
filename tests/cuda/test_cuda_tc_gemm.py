"""The bf16 tensor-core GEMM (toygraph/ops/gemm/tc_gemm.cu, lowered by tc_gemm.py) on the
host executor: the launches a matmul lowers to, run against an f64 numpy product of the
bf16-rounded operands at ragged shapes (tile edges, k off the 8/32 grid, transposes, batch
broadcast, grouped-query), deterministic split-K (bit-identical run to run and under the
reverse schedule), the split counts of the training step's weight-gradient shapes, a
deliberately broken fragment or staging index failing the parity check, the whole matmul
op (forward and gradients) through a bf16 session against numpy, and ptxas's report.

Tolerance, derived (not tuned): the reference is computed in f64 from the same bf16
operands the kernel reads, so the products are exact and only the f32 accumulation
differs: n additions in f32 (K along k, then splits - 1 for the split sum) err by at
most gamma_n = n u / (1 - n u) times sum_k |a_mk b_kn|, u = 2^-24; bound: 1.01 n u
(|A| |B|) elementwise.
"""
import numpy as np
import pytest

from support.cudaemu import needs_nvrtc
from support.hostparity import MIXED_TOL, compare_op, rel_err
from support.tcattn_reference import bf16_bits, bf16_value
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.ops.gemm import cuda as gemm
from toygraph.ops.gemm import cuda_tc as tc_gemm
from toygraph.ops.loss import cuda as loss_ops
from toygraph.ops.gemm.cuda_tc import Gemm, gemm_launches, split_count
from toygraph.cuda.host.device import by_value, run_kernel
from toygraph.ops.lowering import dispatch, sources
from support.ptxas import ARCHS  # noqa: E402

FILES = ("tc_layout.cuh", "tc_matmul.cu", "tc_async.cuh", "tc_gemm.cu")


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def tcg_source() -> str:
    return sources.module_source(FILES)


def _aligned(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer whose data is 256-byte aligned (cp.async wants 16)."""
    raw = np.zeros(nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    return raw[off:off + nbytes]


# Fake device addresses of the launches' buffers; run() maps them onto numpy arrays.
BASES = {"out": 1 << 40, "a": 2 << 40, "b": 3 << 40, "scratch": 4 << 40}


def run(g: Gemm, a, b, source=None) -> np.ndarray:
    """gemm_launches(g) run on the host executor: C as float32 [nbatch, M, N]."""
    out = np.full((g.nbatch, g.M, g.N), np.nan, np.float32)
    bufs = {"out": out.view(np.uint8).reshape(-1),
            "a": np.ascontiguousarray(a, np.float32).view(np.uint8).reshape(-1),
            "b": np.ascontiguousarray(b, np.float32).view(np.uint8).reshape(-1),
            "scratch": _aligned(max(g.scratch(), 256))}
    for launch in gemm_launches(g, BASES["out"], BASES["a"], BASES["b"], BASES["scratch"],
                                "test"):
        args = []
        for x in launch.args:
            if x.dtype == np.uint64 and int(x[0]) == 0:   # a null pointer (no epilogue add)
                args.append(np.uint64(0))
            elif x.dtype == np.uint64:   # a pointer: base + offset
                name = max((n for n, v in BASES.items() if v <= int(x[0])), key=BASES.get)
                args.append(bufs[name][int(x[0]) - BASES[name]:])
            elif x.size > 1:
                args.append(by_value(x))
            else:
                args.append(x[0])
        run_kernel(launch.kernel, launch.grid, launch.block, args,
                   source=source or tcg_source())
    return out


def rounded(x):
    return bf16_value(bf16_bits(x)).astype(np.float64)


def matmul_case(sa, sb, ta, tb, seed=0):
    """(Gemm of the matmul node, a, b, f64 reference of the rounded operands, |A||B|)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=sa).astype(np.float32)
    b = rng.normal(size=sb).astype(np.float32)
    g = Graph()
    node = ops.matmul(g.const("a", a), g.const("b", b), trans_a=ta, trans_b=tb)
    from toygraph.ops import KERNELS
    ref, mag = np.zeros(node.shape), np.zeros(node.shape)
    KERNELS["matmul"](ref, [rounded(a), rounded(b)], node.attrs)
    KERNELS["matmul"](mag, [np.abs(rounded(a)), np.abs(rounded(b))], node.attrs)
    return gemm.matmul_gemm(node), a, b, ref, mag


def check(g, got, ref, mag):
    n = g.K + g.splits - 1
    bound = 1.01 * n * 2.0 ** -24 * mag + 1e-30
    err = np.abs(got.reshape(ref.shape) - ref)
    assert (err <= bound).all(), ("C", float(err.max()), float((err / bound).max()))


# (a shape, b shape, trans_a, trans_b): tile edges, k off 8 and 32, every layout
SHAPES = {
    "ragged": ((150, 45), (45, 70), False, False),
    "both-transposed": ((45, 150), (70, 45), True, True),
    "k-not-multiple-of-8": ((20, 13), (13, 9), False, False),
    "batched-weight": ((3, 20, 37), (37, 130), False, False),
    "broadcast-batch": ((2, 3, 17, 24), (1, 3, 24, 9), False, False),
    "grouped-query-scores": ((2, 4, 9, 16), (2, 2, 9, 16), False, True),
    "grouped-query-values": ((2, 4, 9, 9), (2, 2, 9, 16), False, False),
    "weight-gradient-split": ((700, 40), (700, 24), True, False),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gemm_matches_the_rounded_f64_product(name):
    g, a, b, ref, mag = matmul_case(*SHAPES[name])
    got = run(g, a, b)
    check(g, got, ref, mag)
    # ... and within the mixed-precision tolerance of the unrounded product
    exact = np.zeros(ref.shape)
    from toygraph.ops import KERNELS
    ta, tb = SHAPES[name][2:]
    KERNELS["matmul"](exact, [a.astype(np.float64), b.astype(np.float64)],
                      {"trans_a": ta, "trans_b": tb})
    assert rel_err(got.reshape(ref.shape), exact) <= MIXED_TOL["bf16"]


def test_split_k_runs_partials_and_their_sum():
    g, a, b, ref, mag = matmul_case(*SHAPES["weight-gradient-split"])
    assert g.splits > 1
    kernels = [l.kernel for l in gemm_launches(g, 1 << 40, 2 << 40, 3 << 40, 4 << 40, "t")]
    assert kernels == ["tg_tcg_to_bf16", "tg_tcg_to_bf16", "tg_tcg_gemm_bf16",
                       "tg_tcg_sum_splits"]


def test_split_k_is_bit_identical_run_to_run_and_under_the_reverse_schedule(monkeypatch):
    g, a, b, ref, mag = matmul_case((1100, 30), (1100, 20), True, False, seed=3)
    assert g.splits >= 4
    first = run(g, a, b)
    again = run(g, a, b)
    monkeypatch.setenv("TOYGRAPH_HOST_SCHEDULE", "reverse")
    reverse = run(g, a, b)
    assert np.array_equal(first.view(np.uint32), again.view(np.uint32))
    assert np.array_equal(first.view(np.uint32), reverse.view(np.uint32))
    check(g, first, ref, mag)


def test_batches_past_the_grid_z_limit_fold_into_grid_x(monkeypatch):
    monkeypatch.setattr(tc_gemm, "MAX_GRID_YZ", 5)
    g, a, b, ref, mag = matmul_case((12, 20, 16), (12, 16, 140), False, False, seed=4)
    launch = [l for l in gemm_launches(g, 1 << 40, 2 << 40, 3 << 40, 4 << 40, "t")
              if l.kernel == "tg_tcg_gemm_bf16"][0]
    assert launch.grid == (2 * 3, 1, 5)   # 2 n-tiles x 3 groups of z, grid z 5 (12 used)
    check(g, run(g, a, b), ref, mag)


# The weight-gradient GEMMs of a training step (K = tokens) and the head's dh (K = vocab
# rows of a chunk's dlogits): (M, N, K).
STEP_SHAPES = {
    "smollm2 lora dA (r 8)": (576, 8, 4096), "smollm2 lora dB": (8, 576, 4096),
    "smollm2 dW q": (576, 576, 4096), "smollm2 dW mlp": (1536, 576, 4096),
    "smollm2 head dh": (1344, 576, 49152),
    "llama1b lora dA (r 16)": (2048, 16, 8192), "llama1b dW k": (512, 2048, 8192),
    "llama1b head dh": (1024, 2048, 128256),
}


@pytest.mark.parametrize("sms", [132, 78, 16])   # an H100/H200 SXM, an L40S-sized GPU, a small one
@pytest.mark.parametrize("name", sorted(STEP_SHAPES))
def test_split_count_fills_the_sms_from_the_shape(name, sms):
    M, N, K = STEP_SHAPES[name]
    tiles = -(-M // 128) * -(-N // 128)
    s = split_count(tiles, K, sms)
    slices = -(-K // 32)
    per = -(-slices // s)
    assert -(-slices // per) == s, "a split is left empty"
    if tiles >= sms:
        assert s == 1
    else:
        # enough blocks for every SM, unless k is too short for more splits
        assert tiles * s >= 0.9 * sms or per <= 2 * tc_gemm.MIN_SPLIT_SLICES
        assert per >= tc_gemm.MIN_SPLIT_SLICES


def test_the_split_follows_the_device_the_backend_opened(monkeypatch):
    """split_count's default is the SM count the runtime said (ops/lowering/device.py): the
    host executor's stand-in 132 (what the goldens ran with), or what a device reports."""
    from toygraph.core.session import Session
    from toygraph.cuda.host.device import HostContext
    from toygraph.errors import CudaError
    from toygraph.ops.lowering import device
    monkeypatch.setattr(device, "_sm_count", device.DEFAULT_SM_COUNT)
    tiles, K = 2, 8192   # LoRA's dA: two output tiles, a long k
    assert split_count(tiles, K) == split_count(tiles, K, 132)
    assert split_count(tiles, K, 16) < split_count(tiles, K, 132)
    monkeypatch.setattr(HostContext, "__init__", _host_with(HostContext.__init__, 16))
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    g = Graph()
    g.output(ops.scale(g.input("x", (4, 4)), 2.0))
    Session(g, backend="cuda").realize()
    assert device.sm_count() == 16 and split_count(tiles, K) == split_count(tiles, K, 16)
    with pytest.raises(CudaError, match="SM count"):
        device.use_sm_count(0)


def _host_with(init, sms):
    def patched(self):
        init(self)
        self.sm_count = sms
    return patched


def test_the_cost_model_picks_copies_for_long_k_and_the_direct_kernel_for_skinny_products():
    """tc_gemm.prefers_copies on a training step's shapes (M, N, K; bench/studies/roofline.py's
    constants): the copies' 8 bytes per operand element lose on memory-bound LoRA products
    (N or K = rank) and win where split-K fills idle SMs or the product is compute-bound."""
    def pick(M, N, K, sam, sak, sbk, sbn):
        return tc_gemm.prefers_copies(Gemm(M, N, K, sam, sak, sbk, sbn))
    assert pick(576, 16, 4096, 1, 576, 16, 1)           # SmolLM2 LoRA dA, K = tokens
    assert pick(1344, 576, 49152, 49152, 1, 576, 1)      # SmolLM2 head dh, K = vocab
    assert pick(4096, 4096, 4096, 4096, 1, 4096, 1)      # large and square
    assert not pick(4096, 16, 576, 576, 1, 1, 576)       # x A^T: N = rank, memory-bound
    assert not pick(8192, 2048, 16, 16, 1, 1, 16)        # (x A^T) B^T: K = rank
    assert not pick(70, 33, 45, 45, 1, 33, 1)            # tiny: launches dominate


def test_batched_products_and_short_k_never_split():
    assert Gemm(20, 20, 5000, 5000, 1, 20, 1, nbatch=2).splits == 1
    assert split_count(1, 4 * 32 - 1) == 1
    assert split_count(200, 100000) == 1


#: One index of tc_gemm.cu changed: the parity check must then fail.
MUTATIONS = {
    "A fragment takes the wrong k half": (
        "+ (lane >> 4) * 8);", "+ ((lane >> 4) ^ 1) * 8);"),
    "B fragment rows of lanes 8-15 and 16-23 swap": (
        "(wn + 8 * j + (lane & 7) + 8 * (lane >> 4)) * TCG_LD",
        "(wn + 8 * j + (lane & 7) + 8 * ((lane >> 3) & 1)) * TCG_LD"),
    "cp.async stages a row's chunk into the neighbouring row": (
        "tg_cp_async16(S + r * TCG_LD + kc,", "tg_cp_async16(S + (r ^ 1) * TCG_LD + kc,"),
    "split partials summed from split 1": (
        "float s = parts[i];", "float s = parts[(long long)(splits > 1) * n + i];"),
}


@pytest.mark.parametrize("mutation", [
    pytest.param(m, marks=() if m.startswith("B fragment") else pytest.mark.slow)
    for m in sorted(MUTATIONS)])
def test_a_broken_index_fails_the_parity_check(mutation):
    old, new = MUTATIONS[mutation]
    real = tcg_source()
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    g, a, b, ref, mag = matmul_case(*SHAPES["weight-gradient-split"])
    got = run(g, a, b, source=real.replace(old, new))
    with pytest.raises(AssertionError, match="'C'"):
        check(g, got, ref, mag)


# --- through the graph: a bf16 session lowers dense matmuls to these kernels ---------------
def test_bf16_lowering_of_a_dense_matmul_uses_the_gemm_and_declares_its_scratch():
    g = Graph()
    node = ops.matmul(g.const("x", np.zeros((700, 40), np.float32)),
                      g.const("y", np.zeros((700, 24), np.float32)), trans_a=True)
    assert dispatch.scratch_bytes(node, "bf16") == gemm.matmul_gemm(node).scratch() > 0
    assert dispatch.scratch_bytes(node, "f32") == dispatch.scratch_bytes(node, "tf32") == 0
    launches = dispatch.lower(node, lambda t: (t.id + 1) << 30, 1 << 40, precision="bf16")
    assert [l.kernel for l in launches] == ["tg_tcg_to_bf16", "tg_tcg_to_bf16",
                                            "tg_tcg_gemm_bf16", "tg_tcg_sum_splits"]
    tf32 = dispatch.lower(node, lambda t: (t.id + 1) << 30, 1 << 40, precision="tf32")
    assert [l.kernel for l in tf32] == ["tg_tc_matmul_tf32"]


@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((70, 45), (45, 33), False, False),
    ((2, 40, 24), (50, 24), False, True),
    ((2, 4, 9, 16), (2, 2, 9, 16), False, True),
    ((1100, 20), (1100, 12), True, False),   # k = 1100 over one tile: split-K, tc_gemm.cu
])
def test_matmul_op_and_its_gradients_on_a_bf16_session_match_numpy(sa, sb, ta, tb):
    """Whichever bf16 kernel the cost model picks for each product (forward and both
    gradients) matches numpy; the last case's forward is tc_gemm.cu's split-K GEMM."""
    g = Graph()
    node = ops.matmul(g.const("a", np.zeros(sa, np.float32)), g.const("b", np.zeros(sb, np.float32)),
                      trans_a=ta, trans_b=tb)
    assert tc_gemm.prefers_copies(gemm.matmul_gemm(node)) == (sa[0] == 1100)
    compare_op(lambda a, b: ops.matmul(a, b, trans_a=ta, trans_b=tb), [sa, sb],
               MIXED_TOL["bf16"], grad_tol=MIXED_TOL["bf16"], precision="bf16")


def test_the_heads_dh_splits_over_the_vocabulary_on_a_bf16_session():
    """linear_cross_entropy's dh = dlogits W (k = V) through tc_gemm.cu with split-K, vs numpy."""
    V, D, N = 700, 24, 40
    labels = np.random.default_rng(2).integers(0, V, N).astype(np.int32)
    g = Graph()
    back = g.node("linear_cross_entropy_back",
                  [g.param("h", np.zeros((N, D), np.float32)),
                   g.param("w", np.zeros((V, D), np.float32)), g.input("l", (N,), "i32"),
                   g.const("g", np.array(1.0))], dict(reduction="mean", grad_h=True,
                                                      grad_w=True))
    assert loss_ops._head_gemms(back, N)[1].splits > 1
    kernels = [l.kernel for l in dispatch.lower(back, lambda t: (t.id + 1) << 30, 1 << 40,
                                                precision="bf16")]
    assert "tg_tcg_sum_splits" in kernels

    def label_input(graph, rng):
        return {graph.input("labels", (N,), "i32"): labels}

    compare_op(lambda h, w, lab: ops.linear_cross_entropy(h, w, lab), [(N, D), (V, D)],
               MIXED_TOL["bf16"], inputs_fn=label_input, grad_tol=MIXED_TOL["bf16"],
               precision="bf16")


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_ptxas_fits_two_blocks_per_sm_without_spills(arch):
    """128 registers x 256 threads and 40 KB of static shared memory per block: two blocks
    per SM (the old tc_matmul kernel: 216-222 registers, one). No stack, no spills."""
    from support.ptxas import bf16_module
    usage = bf16_module(arch)[1]
    for name in ("tg_tcg_gemm_bf16", "tg_tcg_gemm2_bf16", "tg_tcg_gemm_ta_bf16",
                 "tg_tcg_gemm_tb_bf16", "tg_tcg_gemm_tab_bf16"):   # dual, k-major
        u = usage[name]
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
        assert 0 < u["registers"] <= 128 and 0 < u["smem"] <= 48 * 1024, (name, u)
    for name in ("tg_tcg_to_bf16", "tg_tcg_sum_splits"):
        assert usage[name]["stack"] == usage[name]["spill_stores"] == 0, usage[name]


# --- block-format weights decoded once into the B copy (tg_tcg_deq_*) ------------------------
@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "f16"])
def test_block_format_weight_decoded_once_on_a_bf16_session(fmt):
    """y = x W^T ("nt") with W in ``fmt``, which the cost model sends to tc_gemm.cu (W
    decoded into the bf16 copy, k = 2048 split 16 ways), and dx = dy W (k = 130: the
    direct block-format kernel): within the f32-accumulation bound of the f64 product of
    the bf16-rounded x, dy and decoded W."""
    from support.hostparity import qlinear, run_phase
    g, w, fetch, _ = qlinear(fmt, 2048, rows=130, batch=(300,), seed=1)
    matmuls = [t for t in g.nodes if t.op == "matmul" and t.srcs[1] is w]
    picks = [tc_gemm.prefers_copies(gemm.block_gemm(m), gemm.row_bytes(w) * w.shape[0])
             for m in matmuls]
    assert picks == [True, False]
    got = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    from toygraph.gguf import blocks
    wv = rounded(blocks.dequantize(w.data, fmt, w.shape))
    x = [t for t in g.nodes if t.name == "x"][0]
    r = [t for t in g.nodes if t.name == "r"][0]
    xv, rv = rounded(np.asarray(x.data)), rounded(np.asarray(r.data))
    for name, value, ref, mag, K in (
            ("y", got[0], xv @ wv.T, np.abs(xv) @ np.abs(wv).T, 2048),
            ("dx", got[1], rv @ wv, np.abs(rv) @ np.abs(wv), 130)):
        n = K + 64      # k along K plus a split sum (at most 64 splits here)
        err = np.abs(value - ref)
        assert (err <= 1.01 * n * 2.0 ** -24 * mag + 1e-30).all(), (name, float(err.max()))


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "f16", "q6_k"])
@pytest.mark.parametrize("kind", ["nt", "nn"])
def test_block_format_copy_is_the_bf16_rounded_numpy_decode(fmt, kind):
    """tg_tcg_deq_{nt,nn}_<fmt>: W [rows, cols] decoded to the GEMM's B copy [N][Kp] (nt:
    W itself, nn: W^T), bf16 bits identical to numpy's decode rounded, zeros past K."""
    from toygraph.gguf import block_encode, blocks
    rows, cols = 45, 512
    rng = np.random.default_rng(3)
    raw = np.frombuffer(block_encode.quantize(rng.normal(size=(rows, cols)).astype(np.float32),
                                              fmt), np.uint8).copy()
    wv = blocks.dequantize(raw, fmt, (rows, cols))
    want = wv if kind == "nt" else wv.T
    N, K = want.shape
    kp = -(-K // 8) * 8
    got = np.full((N, kp), 0xFFFF, np.uint16)
    launch = tc_gemm.deq_launch(fmt, kind, 0, 0, N, K, kp, blocks.nbytes(fmt, (1, cols)))
    run_kernel(launch.kernel, launch.grid, launch.block,
               [got, raw, *(a[0] for a in launch.args[2:])], source=tcg_source())
    assert np.array_equal(got[:, :K], bf16_bits(want)) and not got[:, K:].any()


def test_scratch_covers_the_block_format_gemm_of_a_batched_input():
    """x [2, 33, K] @ W^T: read densely it is a batch of 2 (no split-K); decoded once, the
    batch folds into M = 66 and k splits, so the node's scratch must hold the split
    partials too (the host executor's heap was corrupted when it did not)."""
    from support.hostparity import qlinear
    g, w, fetch, _ = qlinear("q8_0", 2048, rows=70, batch=(2, 33), seed=0)
    node = [t for t in g.nodes if t.op == "matmul" and t.srcs[1] is w][0]
    b = gemm.block_gemm(node)
    assert b.splits > 1 and gemm.matmul_gemm(node).splits == 1
    assert tc_gemm.prefers_copies(b, gemm.row_bytes(w) * w.shape[0])
    assert dispatch.scratch_bytes(node, "bf16") >= b.scratch()
