"""The CPU engine's replay kernels (toygraph/ops/<family>/cpu.h through cpu/replay.py)
against the numpy kernels they replace, at ragged shapes.

The reference is the op's numpy kernel run on f64 copies of the same inputs (what the f32
kernels both approximate); the engine's f32 result must be as close to it as the numpy
kernel's own f32 result is, within a factor, plus a few units of f32 rounding of the
result's scale: ``|engine - f64| <= 4 |numpy_f32 - f64| + 2^-18 max|f64|``. A kernel
that reads a wrong element misses that by orders of magnitude (the broken-kernel tests).
The results must not depend on the number of threads, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from toygraph.cpu import engine
from toygraph.cpu.block_tensor import BlockTensor
from toygraph.cpu.replay import REPLAYS, Program
from toygraph.gguf import block_encode
from toygraph.ops import KERNELS
from toygraph.ops.gated import up_offset
import toygraph.ops.replays  # noqa: F401

SLACK = 2.0 ** -18


@pytest.fixture(scope="module", autouse=True)
def lib():
    if engine.library() is None:
        pytest.skip("no host C++ compiler: no engine to replay in")
    yield engine.library()
    engine.use_threads(None)


def rand(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def as64(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a


def run_engine(op, out, srcs, attrs, lib=None):
    call = REPLAYS[op](None, out, srcs, attrs)
    assert call is not None, f"the replay of {op} refused these operands"
    Program([call], [op], lib).run()
    return out


def check_op(op, out_shape, srcs, attrs, lib=None, out_size=None):
    """The engine's result of ``op`` against the f64 reference, within the bound; returns
    the engine's result. Every output starts as nan: what the numpy kernel leaves
    unwritten (glu_back's alignment gap) the engine must leave too, and the rest it must
    write."""
    n = out_size if out_size is not None else int(np.prod(out_shape))
    ref = np.full(n, np.nan, np.float64).reshape(out_shape)
    KERNELS[op](ref, [as64(s) for s in srcs], attrs)
    f32 = np.full(out_shape, np.nan, np.float32)
    KERNELS[op](f32, [np.copy(s) for s in srcs], attrs)
    got = run_engine(op, np.full(out_shape, np.nan, np.float32), [np.copy(s) for s in srcs],
                     attrs, lib)
    unwritten = np.isnan(ref) & np.isnan(f32)
    assert np.array_equal(np.isnan(got), unwritten), f"{op}: writes other elements than numpy"
    ref, f32, got = ref[~unwritten], f32[~unwritten], got[~unwritten]
    bound = 4 * np.abs(f32 - ref) + SLACK * (np.max(np.abs(ref)) if ref.size else 0)
    err = np.abs(got.astype(np.float64) - ref)
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert np.all(err <= bound), (f"{op}: error {err[worst]:.3g} at {worst} over the bound "
                                  f"{bound[worst]:.3g} (numpy's own error "
                                  f"{abs(f32 - ref)[worst]:.3g})")
    return run_engine(op, np.full(out_shape, np.nan, np.float32), [np.copy(s) for s in srcs],
                      attrs, lib)


def check_bits_across_threads(op, out_shape, srcs, attrs, counts=(1, 2, 3)):
    """The engine's result of ``op`` is the same bits at every thread count."""
    results = []
    for n in counts:
        engine.set_threads(n)
        results.append(run_engine(op, np.full(out_shape, np.nan, np.float32),
                                  [np.copy(s) if isinstance(s, np.ndarray) else s for s in srcs],
                                  attrs))
    engine.use_threads(None)
    for n, r in zip(counts[1:], results[1:]):
        assert np.array_equal(r, results[0], equal_nan=True), f"{op}: {n} threads differ from 1"


# --- elementwise, norm, gated, rotary ------------------------------------------------------------
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@pytest.mark.parametrize("n", [1, 17, 4099, 40_000])
def test_elementwise(op, n):
    check_op(op, (n,), [rand(n, seed=1), rand(n, seed=2)], {})


def test_scale():
    check_op("scale", (3, 1001), [rand(3, 1001)], {"s": 0.3})


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(1, 7), (5, 576), (3, 4, 1000)])
def test_rms_norm(weighted, shape):
    srcs = [rand(*shape, scale=3.0)] + ([rand(shape[-1], seed=3)] if weighted else [])
    check_op("rms_norm", shape, srcs, {"eps": 1e-6})


@pytest.mark.parametrize("weighted,added", [(True, True), (True, False), (False, True), (False, False)])
def test_rms_norm_back(weighted, added):
    shape = (7, 333)
    srcs = [rand(*shape, seed=1), rand(*shape, seed=2)]
    srcs += [rand(shape[-1], seed=3)] if weighted else []
    srcs += [rand(*shape, seed=4)] if added else []
    check_op("rms_norm_back", shape, srcs, {"eps": 1e-5, "weighted": weighted})


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("n", [5, 4097])
def test_glu(act, n):
    check_op("glu", (n,), [rand(n, seed=1, scale=4.0), rand(n, seed=2)], {"act": act})


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("n", [5, 4097])
def test_glu_back(act, n):
    size = up_offset(n) + n
    srcs = [rand(n, seed=1, scale=4.0), rand(n, seed=2), rand(n, seed=3)]
    got = check_op("glu_back", (size,), srcs, {"act": act})
    assert np.isnan(got[n:up_offset(n)]).all()   # the alignment gap is not written


def test_exp_edges():
    """exp past f32's range: 0 below (a masked score's exp is exactly 0), inf above, so
    silu at the ends is x / inf = -0 and x / 1 = x, as numpy's, never nan."""
    x = np.array([-1e4, -104.0, -88.0, 0.0, 88.0, 89.0, 1e4], np.float32)
    got = run_engine("glu", np.empty_like(x), [x, np.ones_like(x)], {"act": "silu"})
    with np.errstate(over="ignore"):
        want = x / (1 + np.exp(-x))
    assert not np.isnan(got).any()
    assert got[0] == 0 and np.signbit(got[0]) and got[1] == 0
    assert np.array_equal(got[-2:], want[-2:])


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("dims,factors,inverse", [(16, False, False), (12, True, True), (16, True, False)])
def test_rope(mode, dims, factors, inverse):
    B, T, H, hd = 2, 5, 3, 16
    pos = np.random.default_rng(0).integers(0, 5000, (B, T)).astype(np.int32)
    srcs = [rand(B, T, H, hd), pos] + ([rand(dims // 2, seed=4) ** 2 + 0.5] if factors else [])
    attrs = {"dims": dims, "base": 10000.0, "mode": mode, "freq_scale": 0.25 if factors else 1.0,
             "inverse": inverse}
    check_op("rope", (B, T, H, hd), srcs, attrs)


def test_rope_angles_follow_the_positions():
    """The kept angle table is for the positions it was made from: new positions (an
    upload between steps) make a new one."""
    x = rand(1, 4, 2, 8)
    attrs = {"dims": 8, "base": 10000.0, "mode": "normal", "freq_scale": 1.0, "inverse": False}
    for start in (0, 100, 0):
        pos = np.arange(start, start + 4, dtype=np.int32).reshape(1, 4)
        check_op("rope", x.shape, [x, pos], attrs)


# --- gemm --------------------------------------------------------------------------------------
def _operands(M, K, N, ta, tb, seed=0):
    a = rand(*((K, M) if ta else (M, K)), seed=seed)
    b = rand(*((N, K) if tb else (K, N)), seed=seed + 1)
    return a, b


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (37, 70, 5), (130, 300, 45), (9, 1000, 33)])
def test_matmul_f32(ta, tb, M, K, N):
    a, b = _operands(M, K, N, ta, tb)
    check_op("matmul", (M, N), [a, b], {"trans_a": ta, "trans_b": tb, "scale_a": 0.5 if ta else 1.0})


def test_matmul_f32_leading_axes_and_a_long_k():
    """a [2, 3, K] rows flattened; a K of 5000 summed in runs (its error stays BLAS's)."""
    check_op("matmul", (2, 3, 20), [rand(2, 3, 40), rand(40, 20, seed=1)],
             {"trans_a": False, "trans_b": False})
    check_op("matmul", (6, 40), [rand(6, 5000), rand(5000, 40, seed=1)],
             {"trans_a": False, "trans_b": False})


@pytest.mark.parametrize("alpha", [1.0, 2.0])
@pytest.mark.parametrize("N", [8, 70])
def test_matmul_add_f32(alpha, N):
    M, K = 50, 64
    a, b = _operands(M, K, N, False, True)
    check_op("matmul_add", (M, N), [rand(M, N, seed=7), a, b],
             {"trans_a": False, "trans_b": True, "alpha": alpha})


@pytest.mark.parametrize("M,K,N", [(1, 8960, 16), (4, 1536, 16), (3, 700, 40), (1, 16, 8960),
                                   (4, 16, 1000), (12, 300, 20)])
def test_few_rows_products_keep_their_bits_at_any_thread_count(M, K, N):
    """Generation's LoRA products (a few rows): x A^T (N the rank, K up to the MLP's width)
    shares its runs of k among the threads where its strips are fewer than them, and
    s u B^T (K the rank) gives a task several strips; both within the f64 bound, and the
    one-thread products (one task, no split) bit for bit at 2 and 3 threads."""
    a, b = _operands(M, K, N, False, True)
    attrs = {"trans_a": False, "trans_b": True}
    check_op("matmul", (M, N), [a, b], attrs)
    check_bits_across_threads("matmul", (M, N), [a, b], attrs)
    check_bits_across_threads("matmul_add", (M, N), [rand(M, N, seed=3), a, b],
                              dict(attrs, alpha=2.0))


def test_k_runs_added_out_of_order_fail_the_thread_check():
    """The runs of k shared among tasks must be added in k order, as one task adds them."""
    old = "const float* run = sums.data() + (strip * k_runs + r) * M * NR;"
    broken = _broken(old, "const float* run = sums.data() + (strip * k_runs + (r ? k_runs - r : 0)) * M * NR;")
    a, b = _operands(1, 8960, 16, False, True)
    attrs = {"trans_a": False, "trans_b": True}
    engine.set_threads(1)
    want = run_engine("matmul", np.zeros((1, 16), np.float32), [a, b], attrs)
    engine.use_threads(None)
    broken.tg_set_threads(2)
    got = run_engine("matmul", np.zeros((1, 16), np.float32), [a, b], attrs, broken)
    assert not np.array_equal(got, want)


def _blocks(fmt, N, K, seed=0):
    w = (np.random.default_rng(seed).standard_normal((N, K)) * 0.1).astype(np.float32)
    return BlockTensor(block_encode.quantize(w, fmt), fmt, (N, K))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("N,K", [(96, 512), (512, 256)])
def test_matmul_on_blocks_is_the_block_kernels_bits(fmt, rows, trans_b, N, K):
    """The same engine products the numpy backend's block kernel calls: the same bits (the
    few-rows dot kernels included), and matmul_add's epilogue rounded as numpy's (applied
    tile by tile inside the products; K = 256 splits the rows of g between tasks)."""
    from toygraph.ops import BLOCK_KERNELS
    w = _blocks(fmt, N, K)
    a = rand(rows, K if trans_b else N)
    shape = (rows, N if trans_b else K)
    attrs = {"trans_a": False, "trans_b": trans_b, "alpha": 0.5}
    for op, srcs in (("matmul", [a, w]), ("matmul_add", [rand(*shape, seed=5), a, w])):
        want = np.zeros(shape, np.float32)
        BLOCK_KERNELS[op][0](want, srcs, attrs, None)
        got = run_engine(op, np.full(shape, np.nan, np.float32), srcs, attrs)
        assert np.array_equal(got, want), op


class _Node:
    """What a sibling replay reads of a node: its attributes."""
    def __init__(self, **attrs):
        self.attrs = {"trans_a": False, "trans_b": True, **attrs}


def _shared_x_outputs(x, weights, lib=None):
    from toygraph.cpu.replay import SIBLINGS
    outs = [np.full((x.shape[0], w.shape[0]), np.nan, np.float32) for w in weights]
    call = SIBLINGS["matmul"]([_Node() for _ in weights], outs, [[x, w] for w in weights])
    assert call is not None and call.kernel == "matmul_blocks_shared_x"
    Program([call], ["matmul"], lib).run()
    return outs


@pytest.mark.parametrize("dot", ["int8", "f32"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_products_of_one_x_are_the_separate_products_bits(monkeypatch, dot, rows):
    """Generation's q, k, v (and gate, up) of one x as one call, x quantized once: every
    output the separate product's, bit for bit, weights of different formats and rows in
    one call (Qwen's v is q8_0 beside a q5_0 q and k), under both product modes."""
    if dot == "f32":
        monkeypatch.setenv("TOYGRAPH_CPU_DOT", "f32")
    x = rand(rows, 256)
    weights = [_blocks(fmt, n, 256, seed=i) for i, (fmt, n) in
               enumerate([("q5_0", 96), ("q5_0", 32), ("q8_0", 32), ("q6_k", 200)])]
    for group in (weights[:3], weights[:2], weights):
        separate = [run_engine("matmul", np.full((rows, w.shape[0]), np.nan, np.float32),
                               [x, w], _Node().attrs) for w in group]
        together = _shared_x_outputs(x, group)
        assert all(np.array_equal(a, b) for a, b in zip(separate, together))


def test_products_of_one_x_refuse_what_they_do_not_take():
    from toygraph.cpu.replay import SIBLINGS
    x, w = rand(2, 256), _blocks("q8_0", 32, 256)
    outs = [np.zeros((2, 32), np.float32)] * 2

    def call(x=x, ws=(w, w), outs=outs, **attrs):
        return SIBLINGS["matmul"]([_Node(**attrs) for _ in ws], list(outs), [[x, v] for v in ws])
    assert call() is not None
    assert call(x=rand(5, 256), outs=[np.zeros((5, 32), np.float32)] * 2) is None  # rows > 4
    assert call(trans_b=False) is None
    assert call(ws=(w, rand(32, 256))) is None                      # an f32 weight
    assert call(ws=(w, _blocks("q8_0", 32, 288))) is None            # another K
    assert call(ws=(w,) * 5, outs=[np.zeros((2, 32), np.float32)] * 5) is None   # > 4


def test_generation_computes_q_k_v_and_gate_up_together_with_the_same_bits(monkeypatch,
                                                                          tiny_llama):
    """The one-token step replays q, k, v and gate, up of one x as one call each (a later
    product's result written aside and moved in where the plan lends its memory in
    between), and every logit is what the separate products give."""
    from support.replayed import replayed_kernels
    from toygraph.cpu import replay
    from toygraph.inference.language_model import LanguageModel

    def logits(lm, n=6):
        context, rows = lm.encode_prompt("the cat", chat=True), []
        stream = lm.next_logits(context, len(context) + n)
        for _ in range(n):
            rows.append(next(stream).copy())
            context.append(int(np.argmax(rows[-1])))
        return rows

    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "engine")
    kernels = replayed_kernels(monkeypatch)
    together = logits(LanguageModel(str(tiny_llama)))
    assert kernels.count("matmul_blocks_shared_x") == 2 * 2   # 2 layers: q,k,v; gate,up
    monkeypatch.setattr(replay, "SIBLINGS", {})
    kernels.clear()
    separate = logits(LanguageModel(str(tiny_llama)))
    assert "matmul_blocks_shared_x" not in kernels
    assert all(np.array_equal(a, b) for a, b in zip(together, separate))


def test_matmul_refusals_keep_the_numpy_kernel():
    """Operands the replay does not take: a strided a, f64, a scaled a on blocks."""
    w = _blocks("q8_0", 32, 64)
    out = np.zeros((4, 32), np.float32)
    assert REPLAYS["matmul"](None, out, [rand(4, 128)[:, :64], w], {"trans_a": False, "trans_b": True}) is None
    assert REPLAYS["matmul"](None, out, [rand(4, 64), w], {"trans_a": False, "trans_b": True,
                                                         "scale_a": 2.0}) is None
    assert REPLAYS["matmul"](None, out.astype(np.float64), [rand(4, 64).astype(np.float64),
                             rand(32, 64).astype(np.float64)], {"trans_a": False, "trans_b": True}) is None


# --- attention ---------------------------------------------------------------------------------
ATTENTION_CASES = {
    # name: (B, H, KV, T, hd, layout, causal, window, segmented, sinks)
    "llama-gqa-token-major": (2, 6, 2, 70, 16, "bthd", True, 0, False, False),
    "heads-first": (1, 2, 2, 33, 20, "bhtd", True, 0, False, False),
    "sliding-window": (1, 4, 1, 131, 8, "bthd", True, 17, False, False),
    "packed-segments": (2, 3, 3, 50, 16, "bthd", True, 0, True, False),
    "not-causal": (1, 2, 1, 65, 32, "bhtd", False, 0, False, False),
    "gpt-oss-sinks-window": (2, 4, 2, 70, 16, "bthd", True, 9, False, True),
}


def _attention_inputs(B, H, KV, T, hd, layout, causal, window, segmented, sinks=False):
    shape = (lambda heads: (B, T, heads, hd)) if layout == "bthd" else (lambda heads: (B, heads, T, hd))
    q, k, v = rand(*shape(H), seed=1), rand(*shape(KV), seed=2), rand(*shape(KV), seed=3)
    srcs = [q, k, v]
    if segmented:
        seg = np.sort(np.random.default_rng(4).integers(0, 4, (B, T)), axis=1).astype(np.int32)
        srcs.append(seg)
    if sinks:
        srcs.append(rand(H, seed=5, scale=2.0))
    attrs = {"scale": hd ** -0.5, "causal": causal, "window": window, "sinks": sinks,
             "layout": layout, "save_lse": True}
    return srcs, attrs


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention(case):
    srcs, attrs = _attention_inputs(*ATTENTION_CASES[case])
    B, H, T = srcs[0].shape[0], *((srcs[0].shape[2], srcs[0].shape[1]) if attrs["layout"] == "bthd"
                                  else srcs[0].shape[1:3])
    check_op("attention", (srcs[0].size + B * H * T,), srcs, attrs)


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_back(case):
    srcs, attrs = _attention_inputs(*ATTENTION_CASES[case])
    q, k = srcs[0], srcs[1]
    fwd = np.zeros(q.size + q.size // q.shape[-1], np.float32)
    KERNELS["attention"](fwd, srcs, attrs)
    g = rand(*q.shape, seed=9)
    H = srcs[-1].size if attrs["sinks"] else 0
    check_op("attention_back", (q.size + 2 * k.size + H,), srcs + [fwd, g], attrs)


def _attention_back_by(scheme, srcs, attrs, threads):
    """attention_back's result with its scheme forced (cpu.h's back_by_phases: 1 a task per
    K/V head, 2 by phases) at ``threads`` threads."""
    q, k = srcs[0], srcs[1]
    fwd = np.zeros(q.size + q.size // q.shape[-1], np.float32)
    KERNELS["attention"](fwd, srcs, attrs)
    operands = srcs + [fwd, rand(*q.shape, seed=9)]
    out = np.full(q.size + 2 * k.size + (srcs[-1].size if attrs["sinks"] else 0), np.nan, np.float32)
    call = REPLAYS["attention_back"](None, out, operands, attrs)
    call.ints = call.ints[:9] + [scheme]
    engine.set_threads(threads)
    try:
        Program([call], ["attention_back"]).run()
    finally:
        engine.use_threads(None)
    return out


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES) + ["long-groups"])
def test_attention_back_by_phases_is_the_same_bits(case):
    """The backward by phases (every block of query rows at once, then every strip of keys)
    against a task per K/V head: the same bits, at 1 to 3 threads, in every case above and
    at 4,200 rows, whose kept P and dS blocks take three groups."""
    spec = ATTENTION_CASES.get(case, (1, 2, 1, 4200, 4, "bthd", True, 0, False, False))
    srcs, attrs = _attention_inputs(*spec)
    per_head = _attention_back_by(1, srcs, attrs, threads=2)
    assert not np.isnan(per_head).any()
    for threads in (1, 2, 3):
        assert np.array_equal(_attention_back_by(2, srcs, attrs, threads), per_head), threads


# --- loss, rows, update ------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("V", [7, 300, 5003])
def test_cross_entropy(reduction, V):
    N = 19
    logits = rand(N, V, scale=4.0)
    labels = np.random.default_rng(1).integers(-1, V, N).astype(np.int32)
    labels[:2] = -1
    check_op("cross_entropy", (), [logits, labels], {"reduction": reduction})
    check_op("cross_entropy_back", (N, V), [logits, labels, np.array(0.7, np.float32)],
             {"reduction": reduction})
    check_op("count_valid", (), [labels], {})


def test_cross_entropy_with_every_label_ignored():
    logits, labels = rand(3, 10), np.full(3, -1, np.int32)
    for reduction in ("sum", "mean"):
        assert run_engine("cross_entropy", np.ones((), np.float32), [logits, labels],
                          {"reduction": reduction}) == 0
        back = run_engine("cross_entropy_back", np.ones((3, 10), np.float32),
                          [logits, labels, np.array(1.0, np.float32)], {"reduction": reduction})
        assert not back.any()


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_k"])
def test_get_rows(fmt):
    ids = np.array([[3, 0, 95], [95, 7, 7]], np.int32)
    if fmt == "f32":
        table = rand(96, 256)
        want = table[ids]
    else:
        table = _blocks(fmt, 96, 256)
        want = np.asarray(table)[ids]
    got = run_engine("get_rows", np.full((2, 3, 256), np.nan, np.float32), [table, ids], {})
    assert np.array_equal(got, want)


def test_global_norm_and_adamw_are_numpys_bits():
    """AdamW is numpy's operations in numpy's order: the same bits; the norm sums squares
    in f64 in another order, within one rounding of f32."""
    grads = [rand(37, 5, seed=1), rand(4099, seed=2), rand(1, seed=3)]
    divisor = np.array(3.0, np.float32)
    norm = check_op("global_norm", (), grads + [divisor], {})
    hp = np.array([1e-3, 0.9, 0.999, 1e-8, 0.01, 1 / 0.1, 1 / 0.001, 0, 0], np.float32)
    for max_norm in (0.0, 0.5):
        state = [[rand(*g.shape, seed=10 + i) for g in grads] for i in range(3)]   # w, m, v
        state[2] = [np.abs(v) for v in state[2]]
        twin = [[np.copy(a) for a in s] for s in state]
        attrs = {"lr_scales": [1.0, 0.5, 2.0], "max_norm": max_norm}
        srcs = state[0] + grads + state[1] + state[2] + [hp, norm, divisor]
        KERNELS["adamw"](None, twin[0] + grads + twin[1] + twin[2] + [hp, norm, divisor], attrs)
        run_engine("adamw", None, srcs, attrs)
        for got, want in zip(sum(state, []), sum(twin, [])):
            assert np.array_equal(got, want)


def test_accumulate():
    acc, value = rand(5000), rand(5000, seed=1)
    want = acc + value
    run_engine("accumulate", None, [acc, value], {})
    assert np.array_equal(acc, want)


# --- threads, broken kernels -------------------------------------------------------------------
def test_results_do_not_depend_on_the_thread_count():
    srcs, attrs = _attention_inputs(*ATTENTION_CASES["llama-gqa-token-major"])
    q, k = srcs[0], srcs[1]
    n_fwd = q.size + q.size // q.shape[-1]
    check_bits_across_threads("attention", (n_fwd,), srcs, attrs)
    fwd = np.zeros(n_fwd, np.float32)
    KERNELS["attention"](fwd, srcs, attrs)
    check_bits_across_threads("attention_back", (q.size + 2 * k.size,), srcs + [fwd, rand(*q.shape)], attrs)
    for ta, tb in ((False, True), (True, False)):
        a, b = _operands(300, 700, 9, ta, tb)
        check_bits_across_threads("matmul", (300, 9), [a, b], {"trans_a": ta, "trans_b": tb})
    check_bits_across_threads("cross_entropy_back", (40, 3000),
                              [rand(40, 3000), np.arange(40, dtype=np.int32), np.array(1.0, np.float32)],
                              {"reduction": "mean"})
    check_bits_across_threads("global_norm", (), [rand(100_000), rand(3), np.array(1.0, np.float32)], {})


def _broken(old: str, new: str):
    text = engine.source()
    assert text.count(old) == 1, f"the mutation's text {old!r} is not in the engine once"
    return engine.load(text.replace(old, new))


BROKEN = {
    # name: (source text, its mutation, the op whose check must then fail)
    "attention reads the next key's row": (
        "attn_gemm(t1 - t0, L, hd, q + q_at(b, h, t0), qt, k + k_at(b, kvh, j0), 1, kt",
        "attn_gemm(t1 - t0, L, hd, q + q_at(b, h, t0), qt, k + k_at(b, kvh, j0) + kt, 1, kt",
        "attention"),
    "rms_norm leaves out the last column": (
        "for (int64_t j = 0; j < d; j++) s += (double)(x[j] * x[j]);",
        "for (int64_t j = 0; j + 1 < d; j++) s += (double)(x[j] * x[j]);", "rms_norm"),
    "one x's products give a weight's tasks to the next weight": (
        "while (task < parts[i].first_task) i--;",
        "while (i > 0 && task <= parts[i].first_task) i--;", "shared_x"),
    "the f32 product packs B one column early": (
        "std::memcpy(dst, B.p + k * B.s0 + n0, (size_t)cols * 4);",
        "std::memcpy(dst, B.p + k * B.s0 + n0 - (n0 > 0), (size_t)cols * 4);", "matmul"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
                                  for i, n in enumerate(BROKEN)])
def test_a_broken_kernel_fails_its_check(name):
    old, new, op = BROKEN[name]
    lib = _broken(old, new)
    if op == "shared_x":
        x = rand(1, 256)
        weights = [_blocks("q8_0", 96, 256, seed=1), _blocks("q4_k", 64, 256, seed=2)]
        separate = [run_engine("matmul", np.zeros((1, w.shape[0]), np.float32), [x, w],
                               _Node().attrs) for w in weights]
        together = _shared_x_outputs(x, weights, lib=lib)
        assert not all(np.array_equal(a, b) for a, b in zip(separate, together))
        return
    if op == "attention":
        srcs, attrs = _attention_inputs(*ATTENTION_CASES["llama-gqa-token-major"])
        shape = (srcs[0].size + 2 * 6 * 70,)
    elif op == "rms_norm":
        srcs, attrs, shape = [rand(4, 33)], {"eps": 1e-6}, (4, 33)
    else:
        srcs, attrs, shape = list(_operands(40, 50, 70, False, False)), {"trans_a": False, "trans_b": False}, (40, 70)
    with pytest.raises(AssertionError, match="over the bound"):
        check_op(op, shape, srcs, attrs, lib=lib)


# --- the numpy backend replaying in the engine -------------------------------------------------
def _engine_runs(monkeypatch, name, threads):
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "engine")
    engine.use_threads(threads)
    try:
        return run_experiment(EXPERIMENTS[name])
    finally:
        engine.use_threads(None)


def test_replayed_runs_are_bit_identical_across_runs_and_thread_counts(monkeypatch):
    runs = [_engine_runs(monkeypatch, "lora_all_tiny_qwen2", n) for n in (1, 2, 2, 3)]
    assert all(r == runs[0] for r in runs[1:])


def test_a_lora_step_is_one_engine_call(monkeypatch):
    """Every node of a LoRA step on a Llama has an engine kernel: the step phase compiles
    to one replayed program (the views the plan made cost nothing), and it is run."""
    from toygraph.core import numpy_backend
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    compiled, runs = [], []
    plain_compile, plain_run = numpy_backend.CpuBackend._compile, Program.run

    def spy_compile(self, nodes):
        steps = plain_compile(self, nodes)
        compiled.append(steps)
        return steps

    def spy_run(self, timed=False):
        runs.append(len(self.nodes))
        plain_run(self, timed)

    monkeypatch.setattr(numpy_backend.CpuBackend, "_compile", spy_compile)
    monkeypatch.setattr(Program, "run", spy_run)
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "engine")
    run_experiment(EXPERIMENTS["lora_qv_tiny_llama"])
    step = max(compiled, key=len)
    assert len(step) == 1 and step[0][0] is None, [s[0] for s in step]
    assert len(step[0][1].nodes) > 50 and runs.count(len(step[0][1].nodes)) == 10


def test_nodes_without_an_engine_kernel_keep_their_numpy_kernel(monkeypatch):
    """An op the engine has no replay for (here get_rows_back, a full fine-tune's embedding
    gradient, with its replay taken away) runs its numpy kernel between two replayed runs,
    and the losses still match numpy's golden."""
    from toygraph.core import numpy_backend
    from toygraph.fixtures.golden import compare
    seen, programs = set(), []
    plain = numpy_backend.CpuBackend._compile

    def spy(self, nodes):
        steps = plain(self, nodes)
        seen.update(op for op, *_ in steps if op is not None)
        programs.append(sum(op is None for op, *_ in steps))
        return steps

    monkeypatch.delitem(REPLAYS, "get_rows_back")
    monkeypatch.setattr(numpy_backend.CpuBackend, "_compile", spy)
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "engine")
    ok, detail, _ = compare("scratch_tiny_llama", "cpu")
    assert ok, detail
    assert seen == {"get_rows_back"} and max(programs) == 2


# --- the fused head, the KV cache --------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("head", ["f32", "q8_0", "q4_k"])
def test_linear_cross_entropy(reduction, head):
    """Rows over two chunks of 128 and a few-row last chunk; ignored rows."""
    N, D, V = 133, 256, 300
    h = rand(N, D, seed=1)
    w = rand(V, D, seed=2, scale=0.2) if head == "f32" else _blocks(head, V, D, seed=2)
    labels = np.random.default_rng(3).integers(-1, V, N).astype(np.int32)
    out_shape = (N,) if reduction == "none" else ()
    if head == "f32":
        check_op("linear_cross_entropy", out_shape, [h, w, labels], {"reduction": reduction})
    else:   # the head in blocks: the numpy backend's block kernel is the reference's twin
        from toygraph.ops import BLOCK_KERNELS
        want = np.zeros(out_shape, np.float32)
        BLOCK_KERNELS["linear_cross_entropy"][0](want, [h, w, labels], {"reduction": reduction})
        got = run_engine("linear_cross_entropy", np.full(out_shape, np.nan, np.float32),
                         [h, w, labels], {"reduction": reduction})
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("head,grad_w", [("f32", True), ("f32", False), ("q6_k", False)])
def test_linear_cross_entropy_back(reduction, head, grad_w):
    N, D, V = 133, 96 if head == "f32" else 256, 70
    h = rand(N, D, seed=1)
    w = rand(V, D, seed=2, scale=0.2) if head == "f32" else _blocks(head, V, D, seed=2)
    labels = np.random.default_rng(3).integers(-1, V, N).astype(np.int32)
    g = rand(N, seed=4) if reduction == "none" else np.array(0.7, np.float32)
    attrs = {"reduction": reduction, "grad_h": True, "grad_w": grad_w}
    size = N * D + (V * D if grad_w else 0)
    if head == "f32":
        check_op("linear_cross_entropy_back", (size,), [h, w, labels, g], attrs)
    else:
        from toygraph.ops import BLOCK_KERNELS
        want = np.zeros(size, np.float32)
        BLOCK_KERNELS["linear_cross_entropy_back"][0](want, [h, w, labels, g], attrs)
        got = run_engine("linear_cross_entropy_back", np.full(size, np.nan, np.float32),
                         [h, w, labels, g], attrs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def _lce_pair(h, w, labels, g, reduction, grad_w, handed: bool, lib=None):
    """The fused head's loss and its gradient as one program, the forward handing the
    backward its first chunk (replay.HANDOFFS) or not; returns (loss, gradient, cell)."""
    from toygraph.cpu.replay import HANDOFF_BYTES, HANDOFFS
    (N, D), V = h.shape, w.shape[0]
    attrs = {"reduction": reduction, "grad_h": True, "grad_w": grad_w}
    loss = np.full((N,) if reduction == "none" else (), np.nan, np.float32)
    grad = np.full(N * D + (V * D if grad_w else 0), np.nan, np.float32)
    forward = REPLAYS["linear_cross_entropy"](None, loss, [h, w, labels], attrs)
    backward = REPLAYS["linear_cross_entropy_back"](None, grad, [h, w, labels, g], attrs)
    cell = np.zeros(HANDOFF_BYTES, np.uint8)
    if handed:
        HANDOFFS[("linear_cross_entropy", "linear_cross_entropy_back")](forward, backward, cell)
    Program([forward, backward], ["linear_cross_entropy", "linear_cross_entropy_back"], lib).run()
    return loss, grad, cell


@pytest.mark.parametrize("N", [1, 77, 133])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("head,grad_w", [("f32", True), ("f32", False), ("q8_0", False)])
def test_the_fused_heads_forward_hands_its_backward_the_same_bits(N, reduction, head, grad_w):
    """The backward given the forward's first chunk of softmax(z) - onehot (the only one
    at 77 rows, the first of two at 133: the forward computes them last to first)
    computes the same bits as the one that recomputes it, and takes it from the cell (its
    address cleared; the chunk's place and size left behind say what was handed)."""
    D, V = 256, 300
    h = rand(N, D, seed=1)
    w = rand(V, D, seed=2, scale=0.2) if head == "f32" else _blocks(head, V, D, seed=2)
    labels = np.random.default_rng(3).integers(-1, V, N).astype(np.int32)
    g = rand(N, seed=4) if reduction == "none" else np.array(0.7, np.float32)
    alone = _lce_pair(h, w, labels, g, reduction, grad_w, handed=False)
    handed = _lce_pair(h, w, labels, g, reduction, grad_w, handed=True)
    assert np.array_equal(handed[0], alone[0], equal_nan=True)
    assert np.array_equal(handed[1], alone[1]) and not np.isnan(handed[1]).any()
    address, start, rows, width = handed[2].view(np.int64)[:4]
    counted = int(np.count_nonzero(labels >= 0))
    assert address == 0, "the backward left the handed chunk in the cell"
    assert counted == 0 or (start, rows, width) == (0, min(counted, 128), V)


def test_a_broken_handoff_changes_the_gradient():
    """A forward that hands over softmax(z) without the onehot (the mutation) gives
    another gradient than the backward that recomputes: the bits-equal test can fail."""
    lib = _broken("zr[label] -= 1.0f;", "(void)label;")
    N, D, V = 40, 256, 300
    h, w = rand(N, D, seed=1), rand(V, D, seed=2, scale=0.2)
    labels = np.random.default_rng(3).integers(0, V, N).astype(np.int32)
    g = np.array(0.7, np.float32)
    alone = _lce_pair(h, w, labels, g, "mean", False, handed=False, lib=lib)
    handed = _lce_pair(h, w, labels, g, "mean", False, handed=True, lib=lib)
    assert np.array_equal(handed[0], alone[0]) and not np.array_equal(handed[1], alone[1])


def test_the_backend_pairs_a_forward_with_its_backward_only_where_it_is_safe():
    """numpy_backend's _handoffs pairs the head's loss with its gradient, but not across a
    node that writes h (here a node whose result is h's memory, and an in-place op writing
    into h), nor across another head loss (one handed chunk is held at a time), nor a
    backward of other sources."""
    from types import SimpleNamespace as Node
    from toygraph.core.numpy_backend import CpuBackend
    from toygraph.cpu.replay import Call
    arrays = {1: np.zeros((4, 8), np.float32), 2: np.zeros((5, 8), np.float32),
              3: np.zeros(4, np.int32), 4: np.zeros((), np.float32), 9: np.zeros((4, 8), np.float32)}
    h, w, labels, g, other = (Node(id=i, op=None, srcs=[]) for i in (1, 2, 3, 4, 9))
    forward = Node(id=10, op="linear_cross_entropy", srcs=[h, w, labels])
    backward = Node(id=11, op="linear_cross_entropy_back", srcs=[h, w, labels, g])
    arrays[12] = arrays[1][1:3]   # a node writing into h
    writes_h = Node(id=12, op="scale", srcs=[g])
    accumulates_into_h = Node(id=13, op="accumulate", srcs=[h, other])
    another = Node(id=14, op="linear_cross_entropy", srcs=[other, w, labels])
    elsewhere = Node(id=15, op="linear_cross_entropy_back", srcs=[other, w, labels, g])
    backend = Node(arrays=arrays, _writes=lambda t, m: CpuBackend._writes(backend, t, m),
                   _replay_call=lambda t, out, srcs: Call(t.op, [out, *srcs]))

    def paired(*order):
        fused = {}
        CpuBackend._handoffs(backend, list(order), fused, set())
        return sorted(fused)

    assert paired(forward, backward) == [10, 11]
    assert paired(forward, writes_h, backward) == []
    assert paired(forward, accumulates_into_h, backward) == []
    assert paired(forward, another, backward) == []
    assert paired(forward, elsewhere) == []
    assert paired(another, forward, backward) == [10, 11]


def _head_fused_engine_runs(monkeypatch, tmp_path, names, before_each=lambda name: None,
                            data=None, **options):
    """run_training on the tiny Llama with the head fused, replayed in the engine, on
    ``data`` (default: test_run's instruction rows), once per name (``before_each(name)``
    first): each run's step and eval losses and its adapter's bytes."""
    import toygraph.recipes.base as recipe_base
    from test_run import events, write_chat_data
    from toygraph.training import RunConfig, run_training
    monkeypatch.setattr(recipe_base, "FUSED_HEAD_ON_CPU", True)
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "engine")
    data = data or write_chat_data(tmp_path / "chat.jsonl")
    runs = []
    for name in names:
        before_each(name)
        out = tmp_path / name
        run_training(RunConfig(data=str(data), out=str(out), **options))
        runs.append(([(e["event"], e.get("loss")) for e in events(out)
                      if e["event"] in ("step", "eval")],
                     (out / "adapter_model.safetensors").read_bytes()))
    return runs


def _pairing_switch(monkeypatch):
    """(the fused head's pairs made, a ``before_each`` for _head_fused_engine_runs that
    turns pairing off for the run named "alone" and on, spied, for "handed")."""
    from toygraph.cpu import replay
    key = ("linear_cross_entropy", "linear_cross_entropy_back")
    pair, paired = replay.HANDOFFS[key], []

    def spy(forward, backward, cell):
        paired.append(cell)
        pair(forward, backward, cell)

    handoffs = {"alone": {}, "handed": {key: spy}}
    return paired, lambda name: monkeypatch.setattr(replay, "HANDOFFS", handoffs[name])


def test_an_sft_run_hands_the_fused_heads_chunk_over_with_the_same_bits(tiny_llama, tmp_path,
                                                                         monkeypatch):
    """Three SFT steps and two evaluations with the head fused, replayed in the engine: the
    backend pairs the step's head loss with its gradient (replay.HANDOFFS; the evaluation's
    loss has no gradient to pair with), and every loss and the trained adapter are the
    same bits as with no pairing."""
    paired, pairing = _pairing_switch(monkeypatch)
    runs = _head_fused_engine_runs(
        monkeypatch, tmp_path, ["alone", "handed"],
        pairing,
        model=str(tiny_llama), targets=("q", "v"), rank=4, alpha=8, steps=3, batch=2,
        seq_len=32, lr=5e-3, val_split=0.25, eval_every=3, quiet=True, seed=7)
    assert len(paired) == 1, f"{len(paired)} pairs: the step's head loss and gradient, once"
    assert [kind for kind, _ in runs[0][0]] == ["eval", "step", "step", "step", "eval"]
    assert runs[1] == runs[0]


def test_a_dpo_run_hands_the_policys_head_chunk_over_with_the_same_bits(tiny_llama, tmp_path,
                                                                        monkeypatch):
    """DPO's step runs the reference's pass first, so nothing of the fused head's lies
    between the policy's head loss and its gradient: the two pair (once a step's plan),
    and every loss and the adapter are the same bits as with no pairing."""
    from pathlib import Path
    paired, pairing = _pairing_switch(monkeypatch)
    pairs = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "preferences.jsonl"
    runs = _head_fused_engine_runs(
        monkeypatch, tmp_path, ["alone", "handed"],
        pairing, data=pairs,
        model=str(tiny_llama), recipe="dpo", targets=("q", "v"), rank=4, alpha=8, steps=3,
        batch=2, seq_len=96, lr=5e-3, val_split=0.25, eval_every=3, quiet=True, seed=7)
    assert len(paired) == 1, f"{len(paired)} pairs: the policy's head loss and gradient, once"
    assert [kind for kind, _ in runs[0][0]] == ["eval", "step", "step", "step", "eval"]
    assert runs[1] == runs[0]


def test_a_training_run_releases_the_kernels_kept_memory(tiny_llama, tmp_path, monkeypatch):
    """run_training frees the memory the engine's kernels keep between calls (the fused
    head's chunk, attention's kept blocks: engine.release) when it ends, and a run after the
    release computes the same losses as the first (the kept memory grows back)."""
    released, release = [], engine.release
    monkeypatch.setattr(engine, "release", lambda: released.append(1) or release())
    runs = _head_fused_engine_runs(monkeypatch, tmp_path, ["first", "second"],
                                   model=str(tiny_llama), steps=2, batch=2, seq_len=32,
                                   quiet=True, seed=3)
    losses = [[loss for kind, loss in run[0] if kind == "step"] for run in runs]
    assert released == [1, 1] and losses[1] == losses[0]


@pytest.mark.parametrize("start,T", [(0, 5), (7, 1), (11, 1)])
def test_cache_write(start, T):
    cache, value = rand(2, 3, 12, 8), rand(2, 3, T, 8, seed=1)
    want = cache.copy()
    KERNELS["cache_write"](want, [want, value, np.array([start], np.int32)], {})
    run_engine("cache_write", cache, [cache, value, np.array([start], np.int32)], {})
    assert np.array_equal(cache, want)


def test_cache_write_never_writes_past_the_cache():
    from toygraph.errors import ToygraphError
    cache = rand(1, 2, 8, 4)
    with pytest.raises(ToygraphError, match="cache_write.*failed"):
        run_engine("cache_write", cache, [cache, rand(1, 2, 2, 4), np.array([7], np.int32)], {})


@pytest.mark.parametrize("R,mask_rows", [(1, False), (3, True)])
def test_cache_attention_reads_only_the_open_rows(R, mask_rows):
    """The fused decode attention against the four numpy kernels it replaces, then again
    with the closed rows holding garbage: they must not be read."""
    from types import SimpleNamespace as Node
    from toygraph.cpu.replay import FUSIONS
    KV, G, L, hd = 2, 3, 40, 16
    q, kc, vc = rand(R, KV, G, hd, seed=1), rand(R, KV, L, hd, seed=2), rand(R, KV, L, hd, seed=3)
    open_len = np.array([9, 1, 40])[:R]
    closed = np.arange(L)[None] >= open_len[:, None]                   # [R, L]
    mask = np.where(closed, -1e30, 0.0).astype(np.float32)
    mask = mask.reshape(R, 1, 1, L) if mask_rows else mask[0]
    nodes = [Node(op="matmul", attrs={"trans_a": False, "trans_b": True}), Node(op="add", attrs={}),
             Node(op="softmax", attrs={"scale": 0.25, "causal": False}),
             Node(op="matmul", attrs={"trans_a": False, "trans_b": False})]
    s = np.zeros((R, KV, G, L), np.float32)
    KERNELS["matmul"](s, [q, kc], nodes[0].attrs)
    p = np.zeros_like(s)
    KERNELS["softmax"](p, [s + mask], nodes[2].attrs)
    want = np.zeros((R, KV, G, hd), np.float32)
    KERNELS["matmul"](want, [p, vc], nodes[3].attrs)
    for garbage in (False, True):
        if garbage:
            for c in (kc, vc):
                c[np.broadcast_to(closed[:, None, :, None], c.shape)] = np.nan
        got = np.full((R, KV, G, hd), np.nan, np.float32)
        calls = FUSIONS[("matmul", "add", "softmax", "matmul")](
            nodes, [s, s + mask, p, got], [[q, kc], [s, mask], [s + mask], [p, vc]])
        Program([c for _, c in calls], ["scores", "values"]).run()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _logits_along(path, mode, monkeypatch, n=12, context=None):
    """Next-token logits after each prefix of the numpy path's greedy continuation."""
    from toygraph.inference import LanguageModel
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", mode)
    lm = LanguageModel(str(path))
    ctx = list(context or [1, 5, 9, 2])
    it = lm.next_logits(ctx, len(ctx) + n)
    rows = []
    for _ in range(n):
        rows.append(next(it).copy())
        ctx.append(int(np.argmax(rows[-1])) if context is None else ctx[len(rows)])
    return rows, ctx


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_generation_replayed_follows_numpy(model, monkeypatch):
    """Prefill and cached decode replayed in the engine (the decode attention fused, over
    the open cache rows only): the logits along numpy's greedy tokens within 1e-5 of their
    scale, the same greedy tokens (f32 dot products for a few rows, so the two differ only
    by the kernels' f32 rounding)."""
    from toygraph.fixtures.experiments import model_path
    monkeypatch.setenv("TOYGRAPH_CPU_DOT", "f32")
    want, tokens = _logits_along(model_path(model), "numpy", monkeypatch)
    got, got_tokens = _logits_along(model_path(model), "engine", monkeypatch)
    scale = max(np.abs(w).max() for w in want)
    assert max(np.abs(g - w).max() for g, w in zip(got, want)) < 1e-5 * scale
    assert got_tokens == tokens
