"""The CPU engine's replay kernels of the elementwise activations and broadcasts, the shape
and slicing copies and sums, get_rows_back, softmax(+back), inv_row_norm, the preference
and policy losses and dropout, against the numpy kernels they replace (test_cpu_replay.py's
check_op: within 4x numpy's own f32 error of the f64 reference, plus 2^-18 of the
result's scale), at ragged shapes and edge values; bit for bit where the kernel does
numpy's exact operations (copies, add.at's order, dropout's hash)."""
from __future__ import annotations

import numpy as np
import pytest
from test_cpu_replay import _broken, check_bits_across_threads, check_op, rand, run_engine
from test_cpu_replay import lib  # noqa: F401  (autouse: skips without a compiler)

from toygraph.cpu.replay import REPLAYS
from toygraph.errors import ToygraphError
from toygraph.ops import KERNELS
import toygraph.ops.replays  # noqa: F401


def numpy_f32(op, out_shape, srcs, attrs, dtype=np.float32):
    out = np.full(out_shape, np.nan if dtype == np.float32 else -7, dtype)
    KERNELS[op](out, [np.copy(s) for s in srcs], attrs)
    return out


def engine_result(op, out_shape, srcs, attrs, dtype=np.float32):
    out = np.full(out_shape, np.nan if dtype == np.float32 else -7, dtype)
    return run_engine(op, out, [np.copy(s) for s in srcs], attrs)


def assert_numpys_bits(op, out_shape, srcs, attrs, dtype=np.float32):
    """The engine writes exactly what the numpy kernel writes (a copy, an ordered sum)."""
    want = numpy_f32(op, out_shape, srcs, attrs, dtype)
    got = engine_result(op, out_shape, srcs, attrs, dtype)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), op


# Past f32's exp range on both sides, the overflow edges, signed zeros.
EDGES = np.array([-1e4, -100.0, -88.8, -88.5, -87.0, -20.0, -7.0, -1e-30, -0.0, 0.0, 1e-30,
                  7.0, 20.0, 87.0, 88.5, 88.8, 100.0, 1e4], np.float32)


def with_edges(n, seed=0, scale=4.0):
    x = rand(n, seed=seed, scale=scale)
    x[:len(EDGES)] = EDGES[:n]
    return x


# --- elementwise -----------------------------------------------------------------------------------
BROADCASTS = [
    # (a's shape, b's shape): generation's mask over [R, KV, G, L], a bias, both sides, 6-D
    ((3, 2, 4, 37), (3, 1, 1, 37)),
    ((3, 2, 4, 37), (37,)),
    ((5, 1, 7), (1, 4, 1)),
    ((1, 33), (6, 33)),
    ((2, 3, 4, 5, 3, 7), (3, 1, 5, 1, 7)),
    ((4099,), ()),
    ((130, 70), (130, 1)),
    ((40_000,), (40_000,)),
]


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@pytest.mark.parametrize("a_shape,b_shape", BROADCASTS)
def test_broadcasting_binary_ops_are_numpys_bits(op, a_shape, b_shape):
    a, b = rand(*a_shape, seed=1), rand(*b_shape, seed=2)
    out_shape = np.broadcast_shapes(a_shape, b_shape)
    check_op(op, out_shape, [a, b], {})
    assert_numpys_bits(op, out_shape, [a, b], {})


def test_a_minus_inf_mask_broadcast():
    scores = rand(2, 2, 3, 40, scale=3.0)
    mask = np.zeros((2, 1, 1, 40), np.float32)
    mask[0, ..., 30:] = -np.inf
    assert_numpys_bits("add", scores.shape, [scores, mask], {})


def test_scale_of_any_shape():
    check_op("scale", (3, 1001), [rand(3, 1001)], {"s": 0.3})
    assert_numpys_bits("scale", (2, 5, 7), [rand(2, 5, 7)], {"s": -1.0})


def test_binary_refusals_keep_the_numpy_kernel():
    """A grouped (non-numpy) broadcast, f64, seven axes that do not merge."""
    out = np.zeros((2, 6), np.float32)
    assert REPLAYS["add"](None, out, [rand(2, 6), rand(2, 3)], {}) is None
    assert REPLAYS["add"](None, out.astype(np.float64), [rand(2, 6).astype(np.float64)] * 2, {}) is None
    shape = (2, 3, 2, 3, 2, 3, 2)
    a, b = rand(*shape), rand(2, 1, 2, 1, 2, 1, 2)
    assert REPLAYS["mul"](None, np.zeros(shape, np.float32), [a, b], {}) is None


ACTIVATIONS = {
    "silu": {}, "silu_back": {}, "gelu": {}, "gelu_back": {}, "sigmoid": {},
    "sigmoid_back": {}, "softcap": {"cap": 30.0}, "softcap_back": {"cap": 15.0},
}


@pytest.mark.parametrize("op", sorted(ACTIVATIONS))
@pytest.mark.parametrize("n", [5, 18, 4099])
def test_activations(op, n):
    srcs = [with_edges(n, seed=1)] + ([rand(n, seed=2)] if op.endswith("_back") else [])
    check_op(op, (n,), srcs, ACTIVATIONS[op])


def test_activations_at_the_exp_edges_are_finite_as_numpys():
    """No nan where numpy has none: exp overflowing to inf, tanh of huge arguments."""
    g = np.ones_like(EDGES)
    for op, attrs in ACTIVATIONS.items():
        srcs = [EDGES] + ([g] if op.endswith("_back") else [])
        want = numpy_f32(op, EDGES.shape, srcs, attrs)
        got = engine_result(op, EDGES.shape, srcs, attrs)
        assert np.array_equal(np.isnan(got), np.isnan(want)), op
        assert np.array_equal(np.isinf(got), np.isinf(want)), op
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (op, got, want)


@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (1.0, 3.5)])
def test_swiglu_oai(alpha, limit):
    n = 4099
    gate, up, g = rand(n, seed=1, scale=6.0), rand(n, seed=2, scale=6.0), rand(n, seed=3)
    gate[:5] = [limit, -limit, np.nextafter(limit, 9, dtype=np.float32), -100.0, 100.0]
    up[:5] = [limit, -limit, np.nextafter(-limit, -9, dtype=np.float32), -100.0, 100.0]
    attrs = {"alpha": alpha, "limit": limit}
    check_op("swiglu_oai", (n,), [gate, up], attrs)
    for wrt in (0, 1):
        got = check_op("swiglu_oai_back", (n,), [gate, up, g], dict(attrs, wrt=wrt))
        want = numpy_f32("swiglu_oai_back", (n,), [gate, up, g], dict(attrs, wrt=wrt))
        assert np.array_equal(got == 0, want == 0), "the clamped elements are the same"


# --- shape -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axes", [
    ((1, 37, 3, 16), (0, 2, 1, 3)),        # generation's [1, T, KV, hd] -> [1, KV, T, hd]
    ((40, 33), (1, 0)),
    ((2, 3, 4, 5, 3, 7), (5, 0, 3, 1, 4, 2)),
    ((4, 1, 5), (1, 2, 0)),
])
def test_permute_is_numpys_bits(shape, axes):
    x = rand(*shape)
    out_shape = tuple(shape[a] for a in axes)
    assert_numpys_bits("permute", out_shape, [x], {"axes": axes})
    ids = np.arange(x.size, dtype=np.int32).reshape(shape)        # ids pass through as they are
    assert_numpys_bits("permute", out_shape, [ids], {"axes": axes}, np.int32)


def test_permute_of_seven_unmergeable_axes_keeps_the_numpy_kernel():
    x = rand(2, 3, 2, 3, 2, 3, 2)
    axes = (6, 5, 4, 3, 2, 1, 0)
    out = np.zeros(tuple(x.shape[a] for a in axes), np.float32)
    assert REPLAYS["permute"](None, out, [x], {"axes": axes}) is None


@pytest.mark.parametrize("shape,target", [
    ((333,), (6, 333)),
    ((2, 1, 4), (2, 3, 4)),
    ((2, 5, 2, 8), (2, 5, 6, 8)),          # grouped: K/V heads to query heads
    ((1,), (5, 5)),
    ((3, 1), (2, 3, 4099)),
])
def test_expand_is_numpys_bits(shape, target):
    assert_numpys_bits("expand", target, [rand(*shape)], {"shape": target})


@pytest.mark.parametrize("shape,target", [
    ((6, 333), (333,)),
    ((6, 333), (6, 1)),
    ((2, 3, 4), (3, 1)),
    ((4, 5, 6), (1, 5, 1)),
    ((2, 5, 6, 8), (2, 5, 2, 8)),          # grouped: query heads to K/V heads
    ((3, 700, 40), (40,)),
    ((5,), ()),
])
def test_sum_to(shape, target):
    x = rand(*shape, scale=3.0)
    check_op("sum_to", target, [x], {"shape": target})


@pytest.mark.parametrize("shape,axis", [((7, 333), None), ((7, 333), 0), ((7, 333), 1),
                                        ((3, 4, 5), 1), ((4099,), 0), ((1,), None)])
def test_sum(shape, axis):
    x = rand(*shape)
    out_shape = () if axis is None else tuple(s for i, s in enumerate(shape) if i != axis)
    check_op("sum", out_shape, [x], {"axis": axis})


def test_copies_that_are_not_views():
    """reshape, contiguous and unpack into their own buffer (the plan's views never reach
    the engine: the backend skips them)."""
    x = rand(6, 50)
    assert_numpys_bits("reshape", (3, 100), [x], {"shape": (3, 100)})
    assert_numpys_bits("contiguous", (6, 50), [x], {})
    assert_numpys_bits("unpack", (7, 11), [x], {"offset": 13, "shape": (7, 11)})
    labels = np.arange(12, dtype=np.int32)
    assert_numpys_bits("reshape", (3, 4), [labels], {"shape": (3, 4)}, np.int32)
    assert REPLAYS["reshape"](None, x.reshape(3, 100), [x], {"shape": (3, 100)}) is None


def test_reduce_and_copies_do_not_depend_on_the_thread_count():
    x = rand(4, 300, 70)
    check_bits_across_threads("sum_to", (70,), [x], {"shape": (70,)})
    check_bits_across_threads("sum", (4, 70), [x], {"axis": 1})
    check_bits_across_threads("sum", (), [x], {"axis": None})
    check_bits_across_threads("permute", (70, 4, 300), [x], {"axes": (2, 0, 1)})
    check_bits_across_threads("add", (4, 300, 70), [x, rand(300, 1)], {})
    check_bits_across_threads("gelu_back", (x.size,), [x.reshape(-1), rand(x.size)], {})


# --- slicing, rows ---------------------------------------------------------------------------------
@pytest.mark.parametrize("start,length", [(0, 7), (3, 7), (13, 7), (0, 20)])
def test_narrow_and_its_backward_are_numpys_bits(start, length):
    x = rand(3, 5, 20)
    assert_numpys_bits("narrow", (3, 5, length), [x], {"start": start, "length": length})
    g = rand(3, 5, length, seed=1)
    assert_numpys_bits("narrow_back", (3, 5, 20), [g], {"start": start, "width": 20})


@pytest.mark.parametrize("K", [1, 64, 200])
def test_get_rows_back_is_add_ats_bits(K):
    """Each output row the sum of its ids' gradient rows in the ids' order, in f32: numpy's
    np.add.at, bit for bit (rows no id names are zeros)."""
    ids = np.random.default_rng(0).integers(0, 50, (3, 17)).astype(np.int32)
    ids[0, :4] = 7                                                    # repeats
    g = rand(3, 17, K, scale=10.0)
    attrs = {"rows": 60}
    check_op("get_rows_back", (60, K), [g, ids], attrs)
    assert_numpys_bits("get_rows_back", (60, K), [g, ids], attrs)
    check_bits_across_threads("get_rows_back", (60, K), [g, ids], attrs)


def test_get_rows_back_refuses_an_id_out_of_range():
    ids = np.array([0, 60], np.int32)
    with pytest.raises(ToygraphError, match="get_rows_back"):
        run_engine("get_rows_back", np.zeros((60, 8), np.float32), [rand(2, 8), ids], {"rows": 60})


# --- norm ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,scale,causal", [
    ((3, 17), 0.7, False),
    ((2, 3, 33, 33), 0.125, True),
    ((1, 1, 5003), 1.0, False),            # the sum of exps in runs
    ((4, 7, 7), 50.0, True),               # large |x|: most exps underflow
])
def test_softmax(shape, scale, causal):
    x = rand(*shape, scale=3.0)
    attrs = {"scale": scale, "causal": causal}
    check_op("softmax", shape, [x], attrs)
    check_bits_across_threads("softmax", shape, [x], attrs)


def test_softmax_over_masked_decode_rows():
    """Generation's decode: [R, KV, G, L] scores plus a -inf mask, not causal."""
    x = rand(2, 2, 3, 40, scale=3.0)
    x[0, ..., 25:] = -np.inf
    check_op("softmax", x.shape, [x], {"scale": 0.125, "causal": False})


def test_softmax_back():
    x = rand(5, 333, scale=2.0)
    y = numpy_f32("softmax", x.shape, [x], {"scale": 1.0, "causal": False})
    check_op("softmax_back", x.shape, [y, rand(5, 333, seed=1)], {"scale": 0.3})


@pytest.mark.parametrize("shape", [(7, 333), (4,), (2, 3, 17)])
def test_inv_row_norm(shape):
    check_op("inv_row_norm", shape[:-1], [rand(*shape)], {})


def test_rms_norm_weighted_by_a_tensor_of_xs_shape():
    """The weight gradient's recomputed x r, weighted by g (norm/__init__.py's _grad_rms)."""
    x, w = rand(5, 576, scale=3.0), rand(5, 576, seed=1)
    check_op("rms_norm", x.shape, [x, w], {"eps": 1e-6})


# --- preference, policy ----------------------------------------------------------------------------
@pytest.mark.parametrize("V", [7, 300, 5003])
def test_token_logprobs(V):
    N = 19
    logits = rand(N, V, scale=4.0)
    logits[3] *= 1000.0                                               # a large-|z| row
    labels = np.random.default_rng(1).integers(-1, V, N).astype(np.int32)
    labels[:2] = -1
    labels[3] = int(np.argmin(logits[3]))                             # far below the max
    check_op("token_logprobs", (N,), [logits, labels], {})
    check_op("token_logprobs_back", (N, V), [logits, labels, rand(N, seed=3)], {})
    check_bits_across_threads("token_logprobs_back", (N, V), [logits, labels, rand(N, seed=3)], {})


def test_token_logprobs_with_every_label_ignored_is_zeros():
    logits, labels = rand(3, 10), np.full(3, -1, np.int32)
    assert not run_engine("token_logprobs", np.ones(3, np.float32), [logits, labels], {}).any()
    back = run_engine("token_logprobs_back", np.ones((3, 10), np.float32),
                      [logits, labels, rand(3)], {})
    assert not back.any()


def test_softplus_and_its_backward():
    x, g = with_edges(4099, scale=10.0), rand(4099, seed=1)
    check_op("softplus", x.shape, [x], {})
    check_op("softplus_back", x.shape, [x, g], {})


def test_log1mexp_and_its_backward():
    x = -np.abs(rand(4099, scale=3.0)) - np.float32(1e-4)
    x[:4] = [np.float32(-np.log(2.0)), np.nextafter(np.float32(-np.log(2.0)), 0), -1e-6, -80.0]
    check_op("log1mexp", x.shape, [x], {})
    check_op("log1mexp_back", x.shape, [x, rand(4099, seed=1)], {})


def test_log1mexp_edges_are_numpys():
    """-inf at 0, nan above, as log(1 - e^x); the backward's -g / 0 is an infinity."""
    x, g = np.array([0.0, 0.5, -0.0], np.float32), np.ones(3, np.float32)
    for op, srcs in (("log1mexp", [x]), ("log1mexp_back", [x, g])):
        with np.errstate(all="ignore"):
            want = numpy_f32(op, x.shape, srcs, {})
        got = engine_result(op, x.shape, srcs, {})
        assert np.array_equal(got, want, equal_nan=True), (op, got, want)


@pytest.mark.parametrize("same", [False, True])
def test_clipped_surrogate(same):
    n = 4099
    logp = rand(n, seed=1)
    old = logp if same else logp + rand(n, seed=2, scale=0.3)
    adv = rand(n, seed=3)
    attrs = {"lo": 0.8, "hi": 1.28}
    check_op("clipped_surrogate", (n,), [logp, old, adv], attrs)
    got = check_op("clipped_surrogate_back", (n,), [logp, old, adv, rand(n, seed=4)], attrs)
    want = numpy_f32("clipped_surrogate_back", (n,), [logp, old, adv, rand(n, seed=4)], attrs)
    assert np.array_equal(got == 0, want == 0), "the clipped elements are the same"


def test_kl_penalty():
    n = 4099
    logp, ref = rand(n, seed=1), rand(n, seed=2)
    ref[:3] = logp[:3] + np.float32(1e-7)                             # expm1 keeps small d's digits
    check_op("kl_penalty", (n,), [logp, ref], {})
    check_op("kl_penalty_back", (n,), [logp, ref, rand(n, seed=3)], {})


# --- dropout ---------------------------------------------------------------------------------------
def _hp(step, micro):
    hp = np.zeros(9, np.float32)
    hp[7], hp[8] = step, micro
    return hp


@pytest.mark.parametrize("p,seed,salt,step,micro", [
    (0.1, 0, 0, 1, 0), (0.5, 123, 7, 99, 3), (0.05, 2**32 - 1, 2**31, 1000, 1),
    (0.3, 5, 1, 0, 0),                     # step 0: evaluation, the identity
    (0.0, 5, 1, 3, 0),                     # nothing drops
])
def test_dropout_is_numpys_mask_bit_for_bit(p, seed, salt, step, micro):
    x, attrs = rand(3, 4099), {"p": p, "seed": seed, "salt": salt}
    assert_numpys_bits("dropout", x.shape, [x, _hp(step, micro)], attrs)
    check_bits_across_threads("dropout", x.shape, [x, _hp(step, micro)], attrs)


def test_dropout_reads_the_step_when_it_runs():
    """The hp row changes between steps without a new program: a new mask each step."""
    from toygraph.cpu.replay import Program
    x, hp, out = rand(5000), _hp(1, 0), np.zeros(5000, np.float32)
    attrs = {"p": 0.5, "seed": 1, "salt": 2}
    prog = Program([REPLAYS["dropout"](None, out, [x, hp], attrs)], ["dropout"])
    masks = []
    for step in (1, 2):
        hp[7] = step
        prog.run()
        assert np.array_equal(out, numpy_f32("dropout", x.shape, [x, hp], attrs))
        masks.append(out != 0)
    assert not np.array_equal(*masks)


# --- broken kernels --------------------------------------------------------------------------------
BROKEN = {
    # name: (source text, its mutation, op, shape, sources, attrs)
    "a broadcast reads the next row of b": (
        "ew_row(out + r * L, a + wk.at(0, r), wk.step(0), b ? b + wk.at(1, r) : &zero,",
        "ew_row(out + r * L, a + wk.at(0, r), wk.step(0), b ? b + wk.at(1, r + 1) : &zero,",
        "add", (3, 5, 7), [rand(3, 5, 7), rand(3, 1, 7, seed=1)], {}),
    "the reduce drops its first summed position": (
        "for (int64_t s = 0; s < S; s++) acc += (double)row[s * sstep];",
        "for (int64_t s = 1; s < S; s++) acc += (double)row[s * sstep];",
        "sum", (6,), [rand(6, 40)], {"axis": 1}),
    "softmax leaves out the last column of its sum": (
        "const float sum = ce_sum_exp(o, valid, top, o);",
        "const float sum = ce_sum_exp(o, valid, top, o) - o[valid - 1];",
        "softmax", (4, 33), [rand(4, 33)], {"scale": 1.0, "causal": False}),
    "get_rows_back adds every row once more": (
        "for (int64_t c = c0; c < c1; c++) o[c] += gk[c];",
        "for (int64_t c = c0; c < c1; c++) o[c] += gk[c] + gk[c] * (k == 0);",
        "get_rows_back", (10, 8), [rand(4, 8), np.array([1, 3, 3, 9], np.int32)], {"rows": 10}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
                                  for i, n in enumerate(BROKEN)])
def test_a_broken_kernel_fails_its_check(name):
    old, new, op, shape, srcs, attrs = BROKEN[name]
    with pytest.raises(AssertionError, match="over the bound"):
        check_op(op, shape, srcs, attrs, lib=_broken(old, new))


# --- whole steps -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["full_tiny_llama", "scratch_tiny_llama", "dpo_qv_tiny_llama",
                                  "orpo_qv_tiny_llama"])
def test_the_step_is_one_engine_call(name, monkeypatch):
    """With these kernels every node of a full fine-tune's, a from-scratch run's, DPO's and
    ORPO's step has one: each phase compiles to one replayed program, and the losses
    match numpy's golden (test_cpu_replay.py checks every golden's tolerance)."""
    from toygraph.core import numpy_backend
    from toygraph.fixtures.golden import compare
    compiled = []
    plain = numpy_backend.CpuBackend._compile

    def spy(self, nodes):
        steps = plain(self, nodes)
        compiled.append([op for op, *_ in steps])
        return steps

    monkeypatch.setattr(numpy_backend.CpuBackend, "_compile", spy)
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "engine")
    ok, detail, _ = compare(name, "cpu")
    assert ok, detail
    assert compiled and all(steps == [None] for steps in compiled), compiled


def test_generation_is_one_engine_call_a_phase(tiny_llama, monkeypatch):
    """The prefill's permutes and the mask adds run in the engine (the decode's softmax is
    in the cache attention the backend fuses): greedy tokens equal numpy's, and nothing
    stays on numpy, so the prefill and the decode step are one engine call each (without
    permute's replay the prefill is 9 steps, without add's both are)."""
    from toygraph.core import numpy_backend
    from toygraph.inference.language_model import LanguageModel
    seen, phases = set(), []
    plain = numpy_backend.CpuBackend._compile

    def spy(self, nodes):
        steps = plain(self, nodes)
        seen.update(op for op, *_ in steps if op is not None)
        phases.append(len(steps))
        return steps

    monkeypatch.setattr(numpy_backend.CpuBackend, "_compile", spy)
    monkeypatch.setenv("TOYGRAPH_CPU_DOT", "f32")
    text = {}
    for mode in ("numpy", "engine"):
        monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", mode)
        seen.clear()
        phases.clear()
        text[mode] = LanguageModel(tiny_llama).generate("the cat sat on", max_new_tokens=12)
    assert text["engine"] == text["numpy"]
    assert not seen and phases == [1, 1], (seen, phases)
