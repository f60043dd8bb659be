"""The CUDA kernels executed on the CPU (toygraph/cuda/host/device.py): the executor itself
(barriers, shuffles, errors, cvt roundings), then every op's forward and backward through
the unchanged CUDA backend on the host device against numpy, at small shapes with ragged
tile edges, with tests/cuda/test_cuda.py's tolerances. A deliberately broken kernel must fail.

Needs g++ (CI installs it in .ci/run); no GPU, never skipped.
"""
import numpy as np
import pytest

from support.hostparity import (ELEMENTWISE, MIXED_TOL, REDUCTION, compare_op, op_case, rel_err, rnd,
                        run_phase)
from support.tiers import one_by_default
from toygraph import ops
from toygraph.cuda import backend as cuda_backend
from toygraph.ops.lowering import sources
from toygraph.cuda.host.device import by_value, run_kernel
from toygraph.ops.lowering.launch import strided
from toygraph.errors import CudaError, SettingError


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


# --- the executor --------------------------------------------------------------------------
_PROBE = r"""
extern "C" __global__ void probe_block(int* out, int n) {
    __shared__ int sh[64];
    int t = threadIdx.x;
    sh[t] = t * 10 + blockIdx.x;
    __syncthreads();                                      // every write is visible after it
    out[blockIdx.x * n + t] = sh[(t + 1) % blockDim.x];
}
extern "C" __global__ void probe_warp(float* out, unsigned* ballots) {
    int t = threadIdx.x;
    float v = (float)t;
    out[4 * t + 0] = __shfl_xor_sync(0xffffffffu, v, 5);
    out[4 * t + 1] = __shfl_down_sync(0xffffffffu, v, 3);
    out[4 * t + 2] = __shfl_sync(0xffffffffu, v, 7);
    out[4 * t + 3] = __shfl_xor_sync(0xffffffffu, v, 2, 4);
    ballots[t] = __ballot_sync(0xffffffffu, t % 3 == 0);
}
extern "C" __global__ void probe_stale_shared(float* out) {
    __shared__ float sh[32];
    if (blockIdx.x == 0) sh[threadIdx.x] = 1.0f;          // block 1 never writes it
    __syncthreads();
    out[blockIdx.x * 32 + threadIdx.x] = sh[threadIdx.x];
}
extern "C" __global__ void probe_race(float* out) {
    __shared__ float sh[32];
    sh[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = sh[(threadIdx.x + 31) % 32];      // no barrier: a race
}
extern "C" __global__ void probe_divergent_barrier(int* out) {
    if (threadIdx.x < 16) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
extern "C" __global__ void probe_cvt(unsigned* out, const float* x, int n) {
    TG_GRID_LOOP(i, n) {
        out[2 * i] = TcBF16::cvt(x[i]);
        out[2 * i + 1] = TcTF32::cvt(x[i]);
    }
}
"""


def _probe_source():
    return sources.module_source(("tc_layout.cuh", "tc_matmul.cu")) + _PROBE


def test_barriers_give_each_block_its_own_shared_memory():
    out = np.zeros((3, 64), np.int32)
    run_kernel("probe_block", (3, 1, 1), (64, 1, 1), [out, np.int32(64)], source=_probe_source())
    t = np.arange(64)
    np.testing.assert_array_equal(out, ((t + 1) % 64) * 10 + np.arange(3)[:, None])


def test_warp_shuffles_and_ballot_follow_cuda_semantics():
    out, ballots = np.zeros((64, 4), np.float32), np.zeros(64, np.uint32)
    run_kernel("probe_warp", (1, 1, 1), (64, 1, 1), [out, ballots], source=_probe_source())
    t = np.arange(64)
    lane, base = t % 32, t - t % 32
    np.testing.assert_array_equal(out[:, 0], base + (lane ^ 5))
    np.testing.assert_array_equal(out[:, 1], np.where(lane + 3 < 32, t + 3, t))
    np.testing.assert_array_equal(out[:, 2], base + 7)
    np.testing.assert_array_equal(out[:, 3], base + (lane ^ 2))
    want = sum(1 << i for i in range(32) if (i % 3 == 0))   # lanes 0, 3, ... of warp 0
    want1 = sum(1 << i for i in range(32) if ((32 + i) % 3 == 0))
    np.testing.assert_array_equal(ballots, [want] * 32 + [want1] * 32)


def test_shared_memory_a_block_did_not_write_is_garbage():
    out = np.zeros((2, 32), np.float32)
    run_kernel("probe_stale_shared", (2, 1, 1), (32, 1, 1), [out], source=_probe_source())
    assert (out[0] == 1).all() and np.isnan(out[1]).all()


def test_a_race_on_shared_memory_shows_under_the_reverse_schedule(monkeypatch):
    runs = []
    for order in ("forward", "reverse"):
        monkeypatch.setenv("TOYGRAPH_HOST_SCHEDULE", order)
        runs.append(np.zeros(32, np.float32))
        run_kernel("probe_race", (1, 1, 1), (32, 1, 1), [runs[-1]], source=_probe_source())
    np.testing.assert_array_equal(runs[0][1:], np.arange(31))   # earlier threads wrote
    assert np.isnan(runs[0][0]) and runs[1][0] == 31 and np.isnan(runs[1][1:]).all()


def test_a_write_past_an_allocation_is_caught_at_the_next_sync():
    from toygraph.cuda.host.device import HostContext
    ctx = HostContext()
    module = ctx.load_module(sources.module_source(("shape.cu",)))
    buf = ctx.alloc(4 * 100)
    params = [np.array([buf], np.uint64), np.array([101], np.int32), np.array([1.0], np.float32)]
    ctx.launch(module.function("tg_fill"), (1, 1, 1), (256, 1, 1), 0,
               np.array([a.ctypes.data for a in params], np.uint64))
    with pytest.raises(CudaError, match="wrote past the end of the 400-byte host-device "
                                        "allocation"):
        ctx.sync()


def test_a_barrier_that_cannot_complete_is_an_error_not_a_hang():
    out = np.zeros(32, np.int32)
    with pytest.raises(CudaError, match=r"probe_divergent_barrier block \(0,0,0\): deadlock: "
                                        r"16 of 32 threads wait at __syncthreads"):
        run_kernel("probe_divergent_barrier", (1, 1, 1), (32, 1, 1), [out],
                   source=_probe_source())


def test_bad_launches_are_errors():
    out = np.zeros(32, np.int32)
    with pytest.raises(CudaError, match="invalid launch"):
        run_kernel("probe_block", (1, 1, 1), (2048, 1, 1), [out, np.int32(1)],
                   source=_probe_source())
    with pytest.raises(CudaError, match="no kernel"):
        run_kernel("tg_nonexistent", (1, 1, 1), (32, 1, 1), [out], source=_probe_source())
    with pytest.raises(CudaError, match="host compile .* failed"):
        run_kernel("x", (1, 1, 1), (1, 1, 1), [], source="this is not C++")


def test_build_is_cached_on_disk_and_a_missing_compiler_is_a_clear_error(tmp_path,
                                                                         monkeypatch):
    from toygraph.cuda.host import compiler
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path))
    src = sources.module_source(("dequant.cu",))
    before = compiler.build_count
    first = compiler.build_library(src)
    assert compiler.build_library(src) == first and compiler.build_count == before + 1
    assert first.parent == tmp_path / "kernels" / "host"
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(CudaError, match=r"host compiler .*no-such-g\+\+. does not run"):
        compiler.build_library(src + "// changed")


def test_device_switch():
    with pytest.raises(SettingError, match="TOYGRAPH_CUDA_DEVICE must be a device ordinal "
                                           "or 'host', got 'gpu0'"):
        cuda_backend.open_device("gpu0")
    assert cuda_backend.CudaBackend().ctx.name == "host"   # from the environment (fixture)


def _round_bf16(x):   # written from the definitions, independently of the shim
    u = x.view(np.uint32).astype(np.uint64)
    return np.where(np.isnan(x), 0x7FFF, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def _round_tf32(x):
    u = x.view(np.uint32).astype(np.uint64)
    r = np.where(np.isinf(x), u, (u + 0x1000) & 0xFFFFE000)
    return np.where(np.isnan(x), 0x7FFFFFFF, r)


def test_cvt_roundings_are_bit_exact():
    """cvt.rn.bf16.f32 (ties to even) and cvt.rna.tf32.f32 (ties away) on ties, near-ties,
    subnormals, infinities, NaN and the largest finite values."""
    rng = np.random.default_rng(0)
    special = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F801000, 0x3F803000,
                        0x00000001, 0x80008000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
                        0xFF800000, 0x7FC00001, 0x00000000, 0x80000000], np.uint32)
    x = np.concatenate([special, rng.integers(0, 2 ** 32, 2000, dtype=np.uint64)
                        .astype(np.uint32)]).view(np.float32)
    out = np.zeros((x.size, 2), np.uint32)
    run_kernel("probe_cvt", (8, 1, 1), (256, 1, 1), [out, x, np.int32(x.size)],
               source=_probe_source())
    np.testing.assert_array_equal(out[:, 0], _round_bf16(x))
    np.testing.assert_array_equal(out[:, 1], _round_tf32(x))


def test_run_kernel_passes_structs_by_value():
    """tg_gather with a Strided walk (a transpose) through the launcher's by_value."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.zeros((4, 3), np.float32)
    run_kernel("tg_gather", (1, 1, 1), (256, 1, 1),
               [out, x, np.int32(12), by_value(strided([4, 3], [1, 4]))],
               source=sources.backend_source("f32"))
    np.testing.assert_array_equal(out, x.T)


# --- every op, f32 ----------------------------------------------------------------------------
def _dora(x, w, a, b, m, s):
    low = ops.scale(ops.matmul(ops.matmul(x, a, trans_b=True), b, trans_b=True), s)
    norm = ops.inv_row_norm(w + ops.scale(ops.matmul(b, a), s))
    return (ops.matmul(x, w, trans_b=True) + low) * (m * norm)


@pytest.mark.parametrize("name,build,shapes,tol", [
    ("scale", lambda x: ops.scale(x, -1.7), [(3, 4)], ELEMENTWISE),
    ("silu", ops.silu, [(7, 300)], ELEMENTWISE),
    ("swiglu", ops.swiglu, [(4, 6), (4, 6)], ELEMENTWISE),
    ("softcap", lambda x: ops.softcap(ops.scale(x, 40.0), 30.0), [(7, 300)], ELEMENTWISE),
    ("rms_norm", lambda x: ops.rms_norm(x, 1e-5), [(2, 3, 8)], REDUCTION),
    ("rms_norm_wide", lambda x: ops.rms_norm(x, 1e-6), [(5, 600)], REDUCTION),
    # the weighted norm, a trainable [D] weight: per head (q/k norms) and wide rows
    ("rms_norm_weight", lambda x, w: ops.rms_norm(x, 1e-5, weight=w), [(2, 3, 4, 8), (8,)],
     REDUCTION),
    ("rms_norm_weight_wide", lambda x, w: ops.rms_norm(x, 1e-6, weight=w), [(5, 600), (600,)],
     REDUCTION),
    ("softmax_wide", lambda x: ops.softmax(x, scale=0.7), [(3, 700)], REDUCTION),
    ("softmax_causal", lambda x: ops.softmax(x, scale=0.5, causal=True), [(2, 3, 9, 9)],
     REDUCTION),
    ("reshape", lambda x: x.reshape(6, 4), [(2, 3, 4)], ELEMENTWISE),
    ("permute_heads", lambda x: x.permute(0, 2, 1, 3), [(2, 5, 3, 4)], ELEMENTWISE),
    ("transpose", lambda x: x.T, [(3, 5)], ELEMENTWISE),
    ("contiguous", ops.contiguous, [(3, 4)], ELEMENTWISE),
    ("sum_all_big", lambda x: ops.sum(x), [(300, 70)], REDUCTION),
    ("sum_axis", lambda x: ops.sum(x, 1), [(3, 4, 2)], REDUCTION),
    ("mean_axis", lambda x: ops.mean(x, -1), [(3, 400)], REDUCTION),
    ("sum_to_rows", lambda x: ops.sum_to(x, (50,)), [(300, 50)], REDUCTION),
    ("sum_to_groups", lambda x: ops.sum_to(x, (2, 2, 3)), [(2, 6, 3)], REDUCTION),
    ("expand_groups", lambda x: ops.expand(x, (2, 6, 3)), [(2, 2, 3)], ELEMENTWISE),
    ("add_bcast", lambda a, b: a + b, [(2, 3, 4), (4,)], ELEMENTWISE),
    ("sub_bcast", lambda a, b: a - b, [(3, 4), (1, 4)], ELEMENTWISE),
    ("mul_bcast", lambda a, b: a * b, [(2, 3, 4), (3, 1)], ELEMENTWISE),
    # DoRA's layer: (x W^T + s x A^T B^T) * m / ||W + s B A||_row, the norm detached
    ("dora_linear", lambda x, w, a, b, m: _dora(x, w, a, b, m, 0.5),
     [(6, 20), (12, 20), (3, 20), (12, 3), (12,)], REDUCTION),
    ("dora_linear_wide_rows", lambda x, w, a, b, m: _dora(x, w, a, b, m, 2.0),
     [(5, 600), (7, 600), (2, 600), (7, 2), (7,)], REDUCTION),
])
def test_op_matches_numpy(name, build, shapes, tol):
    compare_op(build, shapes, tol)


MATMUL_CASES = [
    ((3, 4), (5, 4), False, True), ((4, 3), (4, 5), True, False),
    ((2, 6, 3, 4), (2, 2, 3, 4), False, True),            # grouped-query scores
    ((2, 6, 3, 3), (2, 2, 3, 4), False, False),           # grouped-query weights @ V
    ((70, 130), (130, 90), False, False), ((130, 70), (90, 130), True, True),
    ((2, 4, 67, 33), (2, 2, 67, 33), False, True),
]


@pytest.mark.parametrize("sa,sb,ta,tb", MATMUL_CASES)
def test_matmul_matches_numpy(sa, sb, ta, tb):
    compare_op(lambda a, b: ops.matmul(a, b, trans_a=ta, trans_b=tb), [sa, sb], REDUCTION)


@pytest.mark.parametrize("prec", ["bf16", "tf32"])
@pytest.mark.parametrize("sa,sb,ta,tb", MATMUL_CASES[2:])
def test_tensor_core_matmul_matches_numpy(prec, sa, sb, ta, tb):
    compare_op(lambda a, b: ops.matmul(a, b, trans_a=ta, trans_b=tb), [sa, sb],
               MIXED_TOL[prec], grad_tol=MIXED_TOL[prec], precision=prec)


@pytest.mark.parametrize("prec", ["bf16", "tf32"])
def test_tensor_core_matmul_is_the_matmul_of_rounded_inputs(prec):
    """The sharp check of the emulated mma.sync fragments: against f64 numpy on inputs
    rounded the way the kernels round them only f32 accumulation error remains."""
    from toygraph.core.graph import Graph
    rng = np.random.default_rng(8)
    g = Graph()
    a, b = g.input("a", (150, 257)), g.input("b", (190, 257))
    y = g.output(ops.matmul(a, b, trans_b=True))
    av, bv = rnd(rng, 150, 257), rnd(rng, 190, 257)
    got = run_phase(g, "cuda", {a: av, b: bv}, "forward", [y], prec)[0]
    rounder = _round_bf16 if prec == "bf16" else _round_tf32
    shift = 16 if prec == "bf16" else 0

    def rounded(v):
        return (rounder(v).astype(np.uint64) << shift).astype(np.uint32).view(np.float32)

    want = rounded(av).astype(np.float64) @ rounded(bv).astype(np.float64).T
    assert rel_err(got, want) <= 1e-5
    assert rel_err(got, av.astype(np.float64) @ bv.astype(np.float64).T) > 1e-5


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("dims", [8, 4])
def test_rope_matches_numpy(mode, dims):
    def pos(g, rng):
        return {g.input("pos", (2, 3), "i32"): np.array([[0, 1, 2], [5, 900, 3]], np.int32)}
    compare_op(lambda x, p: ops.rope(x, p, dims=dims, base=10000.0, mode=mode),
               [(2, 3, 2, 8)], ELEMENTWISE, inputs_fn=pos)


def test_get_rows_and_its_gradient_with_repeats():
    def ids(g, rng):
        return {g.input("ids", (3, 40), "i32"): rng.integers(0, 7, size=(3, 40)).astype(np.int32)}
    compare_op(lambda t, i: ops.get_rows(t, i), [(7, 300)], ELEMENTWISE, inputs_fn=ids)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("labels", [[1, -1, 5, 0, -1], [-1, -1, -1, -1, -1]])
def test_cross_entropy_matches_numpy(reduction, labels):
    def lab(g, rng):
        return {g.input("lab", (5,), "i32"): np.array(labels, np.int32)}
    compare_op(lambda lg, lb: ops.cross_entropy(lg, lb, reduction).reshape(1), [(5, 300)],
               REDUCTION, inputs_fn=lab)


@pytest.mark.parametrize("B,H,KV,T,hd,causal", [
    (2, 4, 4, 5, 8, True),                                # one partial tile
    (2, 6, 2, 37, 16, True), (1, 6, 2, 37, 16, False),    # grouped-query, T off the tile
    (1, 3, 1, 70, 64, True),                              # HD=64, causal tile skipping
    (1, 2, 2, 20, 100, True), (1, 2, 1, 35, 128, False),  # the HD=128 kernels
])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_forward_and_backward_match_numpy(B, H, KV, T, hd, causal, layout):
    """Heads first, and token-major (strided rows, no permute) at the same shapes."""
    shapes = [(B, T, n, hd) if layout == "bthd" else (B, n, T, hd) for n in (H, KV, KV)]
    compare_op(lambda q, k, v: ops.attention(q, k, v, scale=hd ** -0.5, causal=causal,
                                             layout=layout), shapes, REDUCTION)


@pytest.mark.parametrize("labels", ["some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("head", ["param", "const"])
def test_linear_cross_entropy_in_ragged_chunks(head, reduction, labels, monkeypatch):
    """Loss, dh and (trainable head) dw over 24-row chunks of 70 rows (ragged last one)."""
    from toygraph.ops.loss import cuda as loss_ops
    from toygraph.core.graph import Graph
    from toygraph.core.autodiff import accumulate_grads, backward
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * 300 * 24)
    rng = np.random.default_rng(0)
    g = Graph()
    N, D, V = 70, 40, 300
    h = g.param("h", rnd(rng, N, D))
    w = (g.param if head == "param" else g.const)("w", rnd(rng, V, D, s=0.5))
    lab = g.input("lab", (N,), "i32")
    loss = g.output(ops.linear_cross_entropy(h, w, lab, reduction=reduction))
    params = [t for t in (h, w) if t.role == "param"]
    grads = accumulate_grads(backward(loss, params))
    labv = (np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)) if labels == "some"
            else np.full(N, -1)).astype(np.int32)
    fetch = [loss] + [grads[p] for p in params]
    cpu = run_phase(g, "cpu", {lab: labv}, "backward", fetch)
    got = run_phase(g, "cuda", {lab: labv}, "backward", fetch)
    for a, b in zip(got, cpu):
        assert rel_err(a, b) <= REDUCTION if np.abs(b).max() else not np.abs(a).max()


@pytest.fixture
def capped_grids(monkeypatch):
    """Grids capped far below the work (as MAX_GRID / MAX_GRID_YZ / SUMSQ_BLOCKS cap them
    for huge tensors on a GPU), so every grid-stride, row and batch loop takes more turns."""
    from toygraph.ops.lowering import launch
    from toygraph.ops.gemm import cuda as matmul_ops
    from toygraph.ops.update import cuda as optim_ops
    monkeypatch.setattr(launch, "MAX_GRID", 3)
    monkeypatch.setattr(matmul_ops, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(optim_ops, "SUMSQ_BLOCKS", 2)


@pytest.mark.parametrize("name,build,shapes,tol", [
    ("silu", ops.silu, [(7, 300)], ELEMENTWISE),
    ("rms_norm", lambda x: ops.rms_norm(x, 1e-5), [(9, 40)], REDUCTION),
    ("rms_norm_weight", lambda x, w: ops.rms_norm(x, 1e-5, weight=w), [(9, 40), (40,)],
     REDUCTION),
    ("softmax_causal", lambda x: ops.softmax(x, scale=0.5, causal=True), [(2, 7, 7)], REDUCTION),
    ("sum_to_cols", lambda x: ops.sum_to(x, (1, 9)), [(700, 9)], REDUCTION),
    ("matmul_batched", lambda a, b: ops.matmul(a, b), [(5, 3, 9, 4), (5, 3, 4, 6)], REDUCTION),
])
def test_ops_with_capped_grids_loop_over_the_rest(name, build, shapes, tol, capped_grids):
    compare_op(build, shapes, tol)


def test_embedding_gradient_with_capped_grids(capped_grids):
    def ids(g, rng):
        return {g.input("ids", (2, 9), "i32"): rng.integers(0, 5, size=(2, 9)).astype(np.int32)}
    compare_op(lambda t, i: ops.get_rows(t, i), [(5, 30)], ELEMENTWISE, inputs_fn=ids)


def test_swiglu_oai_forward_and_backward_match_numpy():
    """gpt-oss's clamped SwiGLU, inputs of scale 6 so both clamps are active."""
    compare_op(lambda a, b: ops.swiglu_oai(a * 6.0, b * 6.0, limit=2.5), [(37, 29), (37, 29)],
               ELEMENTWISE)


@pytest.mark.parametrize("window,layout", [(0, "bhtd"), (5, "bhtd"), (5, "bthd")])
def test_attention_with_sinks_matches_numpy(window, layout):
    """flash_attention.cu with sinks (gpt-oss): forward, dq/dk/dv and d sinks
    (tg_attn_bwd_sinks, from the L the forward saved) against numpy, grouped-query, T off
    the tile."""
    shapes = [(2, 37, n, 16) if layout == "bthd" else (2, n, 37, 16) for n in (4, 2, 2)]
    compare_op(lambda q, k, v, s: ops.attention(q, k, v, scale=0.3, window=window, sinks=s,
                                                layout=layout), shapes + [(4,)], REDUCTION)


# --- a broken kernel must fail -----------------------------------------------------------------
MUTATIONS = {   # one index expression each, as a careless edit would change it
    "matmul drops the last k of a ragged tile": (
        "matmul.cu", "(gm < M && gk < K) ? A[gm * sam", "(gm < M && gk < K - 1) ? A[gm * sam"),
    "attention lets a query see the next key": ("flash_attention.cu", "(!causal || j <= i)",
                                                "(!causal || j <= i + 1)"),
    "the sinks' gradient reads the next head's row statistics": (
        "sinks", "const long long at = ((long long)(x / T) * H + h) * T + x % T;",
        "const long long at = ((long long)(x / T) * H + (h + 1) % H) * T + x % T;"),
    "the forward saves L in the next head's row": (
        "attention", "lse[((long long)b * H + h) * T + i] = __fadd_rn(m, logf(l));",
        "lse[((long long)b * H + (h + 1) % H) * T + i] = __fadd_rn(m, logf(l));"),
    "token-major rows are taken hd apart": (
        "token-major", "return tok ? heads * hd : hd;", "return tok ? hd : hd;"),
}


@pytest.mark.parametrize("mutation", one_by_default(MUTATIONS))
def test_a_broken_kernel_fails_its_parity_check(mutation, monkeypatch):
    """The module the backend compiles, with one index expression changed: the parity
    check that passes on the real source must fail, so the kernel bodies really run."""
    family, old, new = MUTATIONS[mutation]
    real = sources.backend_source("f32")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    broken = real.replace(old, new)
    monkeypatch.setattr(cuda_backend, "backend_source", lambda precision="f32": broken)
    if family == "matmul.cu":
        build, shapes = (lambda a, b: ops.matmul(a, b)), [(20, 37), (37, 9)]
    elif family == "sinks":
        build = lambda q, k, v, s: ops.attention(q, k, v, scale=0.3, sinks=s)  # noqa: E731
        shapes = [(1, 4, 20, 16), (1, 2, 20, 16), (1, 2, 20, 16), (4,)]
    elif family == "token-major":
        build = lambda q, k, v: ops.attention(q, k, v, scale=0.25, layout="bthd")  # noqa: E731
        shapes = [(1, 9, 4, 16), (1, 9, 2, 16), (1, 9, 2, 16)]
    else:
        build = lambda q, k, v: ops.attention(q, k, v, scale=0.25, causal=True)  # noqa: E731
        shapes = [(1, 2, 9, 16)] * 3
    g, extra, fetch = op_case(build, shapes)
    want = run_phase(g, "cpu", extra, "backward", fetch)
    got = run_phase(g, "cuda", extra, "backward", fetch)
    # Outside the tolerance, or NaN (elements a broken store never wrote).
    assert not all(rel_err(a, b) <= 1e-2 for a, b in zip(got, want))
