"""The tensor-core flash attention kernels (toygraph/ops/flash_attention/tc_attention.cu) on the host
executor against an f64 numpy reference (tests/support/tcattn_reference.py) at ragged shapes:
sequence lengths off the 64-row and key-tile edges, grouped-query heads, head dims below
their bound (zero-padded), sliding windows, packed segments and sinks, head dims 64, 128
and 256, heads-first and token-major layouts -- and a deliberately broken ldmatrix fragment
or output stride must fail the same check.

Tolerances, derived (not tuned). The reference is computed from the same bf16-rounded
q, k, v the kernels read, so what remains is:
- o: P is rounded to bf16 (relative error <= u = 2^-8, bf16's unit roundoff) before
  P V, while the row sum l uses the f32 P: o_i - o_ref_i = sum_j p_j delta_j v_j / l with
  |delta_j| <= u, so |o - o_ref| <= u max|v|. f32 accumulation adds ~HD 2^-24 relative,
  covered by a 1% margin on the bound.
- the log-sum-exp: f32 only (scores of bf16 operands are exact products summed in f32):
  |error| <= HD 2^-24 (|L| + scale sum_d |q_d k_d|) plus a few ulps of expf/logf, bounded
  here by 2^-16 (1 + |L| + scale max_j sum_d |q_d k_d|).
"""
import numpy as np
import pytest

from support.cudaemu import needs_nvrtc
from support.hostparity import MIXED_TOL, compare_op
from support.tcattn_reference import (BF16_U, backward_bounds, bf16_bits, bf16_value, reference,
                              run_backward, run_forward, tca_source)
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.ops.flash_attention import backward_node
from toygraph.ops.lowering import constants, dispatch
from support.ptxas import ARCHS  # noqa: E402


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def _case(B, H, KV, T, hd, seed=0, segments=None, sinks=False):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, n, T, hd)).astype(np.float32) for n in (H, KV, KV))
    segs = None
    if segments:   # packed examples: ids 0, 0, ..., 1, 1, ... cut at the given positions
        segs = np.zeros((B, T), np.int32)
        for cut in segments:
            segs[:, cut:] += 1
    sk = rng.normal(size=H).astype(np.float32) if sinks else None
    return q, k, v, segs, sk


def check_forward(q, k, v, scale, causal=True, window=0, segs=None, sinks=None, source=None,
                  token_major=False):
    o, lse = run_forward(q, k, v, scale, causal, window, segs, sinks, source=source,
                         token_major=token_major)
    qr, kr, vr = (bf16_value(bf16_bits(x)) for x in (q, k, v))
    ro, rl = reference(qr, kr, vr, scale, causal, window, segs, sinks)
    o_bound = 1.01 * BF16_U * np.abs(vr).max()
    G = q.shape[1] // k.shape[1]
    qk = scale * np.abs(qr.astype(np.float64)) @ np.swapaxes(np.abs(np.repeat(kr, G, 1)), -1, -2)
    l_bound = 2.0 ** -16 * (1 + np.abs(rl) + qk.max(-1))
    assert np.abs(o - ro).max() <= o_bound, ("o", np.abs(o - ro).max(), o_bound)
    assert (np.abs(lse - rl) <= l_bound).all(), ("lse", np.abs(lse - rl).max())
    return o, lse


# (B, H, KV, T, hd, causal, window, segment cuts, sinks): small shapes, every feature
FORWARD = {
    "gqa-ragged": (1, 4, 2, 70, 64, True, 0, None, False),
    "hd40-padded": (1, 2, 1, 33, 40, True, 0, None, False),
    "noncausal": (2, 2, 2, 45, 64, False, 0, None, False),
    "window": (1, 2, 1, 90, 64, True, 20, None, False),
    "segments": (1, 2, 2, 70, 64, True, 0, (13, 50), False),
    "sinks-window": (1, 4, 1, 40, 64, True, 16, None, True),
    "hd128": (1, 2, 1, 37, 128, True, 0, None, False),
    "hd256": (1, 2, 2, 20, 256, True, 0, None, False),
}


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_forward_matches_the_f64_reference(name):
    B, H, KV, T, hd, causal, window, cuts, sinks = FORWARD[name]
    q, k, v, segs, sk = _case(B, H, KV, T, hd, segments=cuts, sinks=sinks)
    check_forward(q, k, v, hd ** -0.5, causal, window, segs, sk)


@pytest.mark.slow
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_forward_at_larger_shapes(hd):
    q, k, v, segs, sk = _case(2, 4, 2, 200, hd, seed=1, segments=(77,))
    check_forward(q, k, v, hd ** -0.5, True, 100, segs, None)


#: FORWARD's cases the token-major layout runs too (every feature, hd 64 and 256).
TOKEN_MAJOR = ("gqa-ragged", "segments", "sinks-window", "hd256")


@pytest.mark.parametrize("name", TOKEN_MAJOR)
def test_token_major_layout_gives_the_same_bits(name):
    """o, L, dq, dk, dv and d sinks with o, dO and the gradients token-major ([B, T, heads,
    hd], stored through the row stride) equal the heads-first run bit for bit: the layout
    moves where rows go, never what is computed."""
    B, H, KV, T, hd, causal, window, cuts, sinks = FORWARD[name]
    q, k, v, segs, sk = _case(B, H, KV, T, hd, segments=cuts, sinks=sinks)
    g = np.random.default_rng(5).normal(size=q.shape).astype(np.float32)
    heads = run_backward(q, k, v, g, hd ** -0.5, causal, window, segs, sk)
    tokens = run_backward(q, k, v, g, hd ** -0.5, causal, window, segs, sk, token_major=True)
    for what, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), tokens, heads):
        assert (a is None and b is None) or np.array_equal(a, b), what


def test_forward_is_bit_identical_run_to_run_and_under_the_reverse_schedule(monkeypatch):
    q, k, v, segs, _ = _case(1, 2, 1, 70, 64, segments=(30,))
    first = run_forward(q, k, v, 0.125, segs=segs)
    monkeypatch.setenv("TOYGRAPH_HOST_SCHEDULE", "reverse")
    again = run_forward(q, k, v, 0.125, segs=segs)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


#: One fragment index of tc_attention.cu changed: the parity check must then fail.
MUTATIONS = {
    "q's A fragment takes the wrong k half": (
        "S + (lane & 15) * LD + ks * 16 + (lane >> 4) * 8",
        "S + (lane & 15) * LD + ks * 16 + ((lane >> 4) ^ 1) * 8"),
    "k's B fragment rows swap between lanes 8-15 and 16-23": (
        "(n0 + (lane & 7) + 8 * (lane >> 4)) * LD",
        "(n0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD"),
    "v's transposed B fragment reads the next row": (
        "(k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD",
        "(k0 + ((lane + 1) & 7) + 8 * ((lane >> 3) & 1)) * LD"),
    "P's A fragment takes row g + 8 for row g": (
        "a[0] = tca_pack(c0[0], c0[1]);", "a[0] = tca_pack(c0[2], c0[3]);"),
    "o's rows are stored hd apart whatever the layout": (
        "dst[(long long)rows[r] * ld + d]", "dst[(long long)rows[r] * hd + d]"),
}


def _mutations(table, default):
    """Each mutation a parameter; all but ``default`` slow (each one is a host build)."""
    return [pytest.param(m, marks=() if m == default else pytest.mark.slow)
            for m in sorted(table)]


@pytest.mark.parametrize("mutation", _mutations(MUTATIONS, "q's A fragment takes the wrong k half"))
def test_a_broken_fragment_index_fails_the_parity_check(mutation):
    old, new = MUTATIONS[mutation]
    real = tca_source()
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    q, k, v, _, _ = _case(1, 2, 1, 40, 64)
    with pytest.raises(AssertionError, match="'o'"):
        check_forward(q, k, v, 0.125, source=real.replace(old, new), token_major=True)


def check_backward(q, k, v, scale, causal=True, window=0, segs=None, sinks=None, seed=5,
                   source=None):
    g = np.random.default_rng(seed).normal(size=q.shape).astype(np.float32)
    got = run_backward(q, k, v, g, scale, causal, window, segs, sinks, source=source)
    refs, bounds = backward_bounds(q, k, v, g, got[0], scale, causal, window, segs, sinks)
    for name, a, r, bd in zip(("dq", "dk", "dv", "dsinks"), got[2:], refs, bounds):
        err = np.abs(a - r)
        assert (err <= bd).all(), (name, err.max(), float(np.abs(r).max()),
                                   float((err / bd).max()))
    return got


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_backward_matches_the_f64_reference(name):
    B, H, KV, T, hd, causal, window, cuts, sinks = FORWARD[name]
    q, k, v, segs, sk = _case(B, H, KV, T, hd, segments=cuts, sinks=sinks)
    check_backward(q, k, v, hd ** -0.5, causal, window, segs, sk)


@pytest.mark.slow
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_backward_at_larger_shapes(hd):
    q, k, v, segs, sk = _case(2, 4, 2, 150, hd, seed=2, segments=(61,), sinks=True)
    check_backward(q, k, v, hd ** -0.5, True, 70, segs, sk)


DQ_COLUMN = "dq reads the key column of the next register pair"
BACKWARD_MUTATIONS = {
    "dk/dv read the query column of the next register pair": (
        "const int i = i0 + nt * 8 + 2 * t + (e & 1);",
        "const int i = i0 + nt * 8 + 2 * t + (e >> 1);"),
    DQ_COLUMN: (
        "const int r = e >> 1, j = kt * TILE + nt * 8 + 2 * t + (e & 1);",
        "const int r = e >> 1, j = kt * TILE + nt * 8 + 2 * t + (e >> 1);"),
}


@pytest.mark.parametrize("mutation", _mutations(BACKWARD_MUTATIONS, DQ_COLUMN))
def test_a_broken_backward_index_fails_the_parity_check(mutation):
    old, new = BACKWARD_MUTATIONS[mutation]
    real = tca_source()
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    q, k, v, _, _ = _case(1, 2, 1, 40, 64)
    with pytest.raises(AssertionError, match="'d[qkv]'"):
        check_backward(q, k, v, 0.125, source=real.replace(old, new))


# --- operands read where they lie (asis): bf16 token-major activations, hd == HD ------------
AS_IS = {   # (B, H, KV, T, hd, causal, window, segment cuts, sinks)
    "gqa-ragged-segments": (2, 4, 2, 70, 64, True, 0, (29,), False),
    "window-sinks-hd128": (1, 2, 1, 45, 128, True, 20, None, True),
}


@pytest.mark.parametrize("name", sorted(AS_IS))
def test_operands_read_as_they_lie_give_the_bits_of_the_copies(name):
    """q, k, v and dO handed over as token-major bf16 activations (the kernels stride
    through heads * HD rows, the prep writes no dO copy) against the heads-first copies of
    the same values: the same products in the same order, so o, L, dq, dk, dv (and dsinks)
    bit for bit. (dO is given in bf16 values: a dO kept in bf16 gives D = rowsum(dO o) its
    rounded values, as it gives them to dP = dO v^T; from an f32 dO the prep sums D from
    the unrounded ones.)"""
    B, H, KV, T, hd, causal, window, cuts, sinks = AS_IS[name]
    q, k, v, segs, sk = _case(B, H, KV, T, hd, seed=3, segments=cuts, sinks=sinks)
    g = bf16_value(bf16_bits(np.random.default_rng(4).normal(size=q.shape).astype(np.float32)))
    args = (q, k, v, g, hd ** -0.5, causal, window, segs, sk)
    copies = run_backward(*args, token_major=True)
    as_is = run_backward(*args, token_major=True, as_is=True)
    for what, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), as_is, copies):
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), what


def test_as_is_rows_read_hd_apart_fail():
    """The as-is operands' row stride taken as the copies' HD: wrong rows, caught."""
    old = "tca_stage_frags<HD>(qf, smem, q + attn_head(b, h, H, T, HD, tq), i0, T, attn_ld(H, HD, tq));"
    real = tca_source()
    assert real.count(old) == 2, "the mutation no longer matches the kernel source"
    broken = real.replace(old, old.replace("attn_ld(H, HD, tq)", "HD"))
    q, k, v, _, _ = _case(1, 2, 1, 40, 64, seed=3)
    g = bf16_value(bf16_bits(np.random.default_rng(4).normal(size=q.shape).astype(np.float32)))
    got = run_backward(q, k, v, g, 0.125, token_major=True, as_is=True, source=broken)
    want = run_backward(q, k, v, g, 0.125, token_major=True)
    assert not np.array_equal(got[0], want[0]) and not np.array_equal(got[2], want[2])


# --- through the graph: the lowering picks these kernels at --precision bf16 ----------------
def _graph_case(hd, sinks=False, segments=False, window=0, layout="bhtd"):
    H, KV, T = 4, 2, 70

    def build(q, k, v, *rest):
        extra = list(rest)
        seg = extra.pop(0) if segments else None
        sk = extra.pop(0) if sinks else None
        return ops.attention(q, k, v, scale=hd ** -0.5, causal=True, window=window,
                             segments=seg, sinks=sk, layout=layout)

    shapes = [(1, T, n, hd) if layout == "bthd" else (1, n, T, hd) for n in (H, KV, KV)]
    shapes += [(H,)] if sinks else []

    def inputs(g, rng):
        if not segments:
            return {}
        ids = np.repeat(np.arange(3, dtype=np.int32), [25, 30, 15])[None]
        return {g.input("segs", (1, T), "i32"): ids}

    if segments:   # the segment ids are an input between v and the sinks
        def build_seg(q, k, v, *rest):
            *params, seg = rest
            return build(q, k, v, seg, *params)
        return build_seg, shapes, inputs
    return build, shapes, None


@pytest.mark.parametrize("hd, sinks, segments, window, layout", [
    (64, False, False, 0, "bhtd"), (64, True, True, 30, "bhtd"), (256, False, False, 0, "bhtd"),
    (64, True, True, 30, "bthd"), (256, False, False, 0, "bthd")])
def test_bf16_session_runs_the_tensor_core_kernels_within_the_bf16_tolerance(
        hd, sinks, segments, window, layout):
    """The whole op, forward and backward, through a bf16 session on the host device
    against the numpy backend in f32 (normwise, hostparity.MIXED_TOL["bf16"], the bf16
    matmuls' tolerance: the kernel-level bounds are above), bit-identical when run again;
    token-major too (the bf16 copies then read q, k, v and dO through their row strides)."""
    build, shapes, inputs = _graph_case(hd, sinks, segments, window, layout)
    compare_op(build, shapes, MIXED_TOL["bf16"], inputs_fn=inputs, grad_tol=MIXED_TOL["bf16"],
               precision="bf16")


def test_bf16_lowers_attention_to_the_tensor_core_kernels_and_f32_does_not():
    g = Graph()
    q = g.const("q", np.ones((1, 2, 5, 64), np.float32))
    k, v = (g.const(n, np.ones((1, 1, 5, 64), np.float32)) for n in "kv")
    att = ops.attention(q, k, v, scale=0.125).srcs[0]
    back = backward_node(att, g.const("g", np.ones(q.shape)))

    def kernels(node, precision):
        return [launch.kernel for launch in dispatch.lower(node, lambda t: (t.id + 1) << 20,
                                                           1 << 40, precision=precision)]
    assert kernels(att, "bf16") == ["tg_tca_to_bf16"] * 3 + ["tg_tca_fwd_64"]
    # The backward reads the forward's L: no statistics pass.
    assert kernels(back, "bf16") == ["tg_tca_to_bf16"] * 3 + [
        "tg_tca_bwd_prep", "tg_tca_bwd_dkdv_64", "tg_tca_bwd_dq_64"]
    for prec in ("f32", "tf32"):
        assert kernels(att, prec) == ["tg_attn_fwd_64"]
        assert not any("tca" in name for name in kernels(back, prec))
    assert dispatch.scratch_bytes(att, "f32") == 0
    assert dispatch.scratch_bytes(att, "bf16") == 2 * 64 * (10 + 2 * 5)


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_the_kernels_compile_for_the_gpus_within_static_shared_memory(arch):
    """NVRTC compiles the inline PTX (ldmatrix, cp.async, mma.sync) for sm_80 and sm_90;
    ptxas's report: every block's static shared memory is the constants' TCA buffer (under
    48 KB, no opt-in), at most 255 registers, and the forward kernels do not spill. (The
    backward's register pressure -- k/v fragments plus dk/dv accumulators per 16-key warp
    slice -- spills at head dims 128/256: bench/ptxas_report.py prints it.)"""
    from support.ptxas import bf16_module
    usage = bf16_module(arch)[1]
    tca = {name: u for name, u in usage.items() if name.startswith("tg_tca_")}
    assert len(tca) == 2 + 3 * len(constants.TCA_HEAD_DIMS)
    for name, u in tca.items():
        assert 0 < u["registers"] <= 255, (name, u)
        HD = name.rsplit("_", 1)[1]
        if HD in {str(b) for b in constants.TCA_HEAD_DIMS}:   # the attention kernels proper
            HD = int(HD)
            assert u["smem"] == 2 * constants.tca_smem_halves(HD) <= 48 * 1024, (name, u)
        if name.startswith("tg_tca_fwd_"):
            assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
