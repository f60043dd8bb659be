"""Every op: a finite-difference gradient check in float64 (max relative error <= 1e-6),
plus shape/dtype errors at build time and forward values against plain numpy."""
import numpy as np
import pytest

from gradcheck import check_gradients, weighted_sum
from toygraph import ops
from toygraph.errors import GraphError
from toygraph.graph import Graph
from toygraph.session import Session

TOL = 1e-6


def rnd(rng, *shape, s=1.0):
    return (rng.normal(size=shape) * s).astype(np.float32)


def gradcheck_unary(build, shape, seed=0, positive=False):
    rng = np.random.default_rng(seed)
    g = Graph()
    init = rnd(rng, *shape)
    if positive:
        init = np.abs(init) + 0.5
    x = g.param("x", init)
    loss = weighted_sum(build(x), rng)
    return check_gradients(g, loss, [x], {})


@pytest.mark.parametrize("name,build,shape", [
    ("scale", lambda x: ops.scale(x, -1.7), (3, 4)),
    ("silu", ops.silu, (3, 5)),
    ("rms_norm", lambda x: ops.rms_norm(x, 1e-5), (2, 3, 8)),
    ("softmax", lambda x: ops.softmax(x, scale=0.7), (2, 5)),
    ("softmax_causal", lambda x: ops.softmax(x, scale=0.5, causal=True), (2, 3, 4, 4)),
    ("reshape", lambda x: x.reshape(6, 4), (2, 3, 4)),
    ("permute", lambda x: x.permute(2, 0, 1), (2, 3, 4)),
    ("transpose", lambda x: x.T, (3, 5)),
    ("contiguous", ops.contiguous, (3, 4)),
    ("sum_all", lambda x: ops.sum(x), (3, 4)),
    ("sum_axis", lambda x: ops.sum(x, 1), (3, 4, 2)),
    ("mean_axis", lambda x: ops.mean(x, -1), (3, 4)),
    ("sum_to", lambda x: ops.sum_to(x, (1, 4)), (3, 4)),
    ("sum_to_groups", lambda x: ops.sum_to(x, (2, 2, 3)), (2, 6, 3)),
    ("expand", lambda x: ops.expand(x, (3, 2, 4)), (2, 1)),
    ("expand_groups", lambda x: ops.expand(x, (2, 6, 3)), (2, 2, 3)),
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


def test_swiglu_gradient():
    rng = np.random.default_rng(2)
    g = Graph()
    a, b = g.param("gate", rnd(rng, 4, 6)), g.param("up", rnd(rng, 4, 6))
    assert check_gradients(g, weighted_sum(ops.swiglu(a, b), rng), [a, b], {}) <= TOL


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


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("dims", [8, 4])
@pytest.mark.parametrize("factors,freq_scale", [(None, 1.0), ([1.0, 2.5, 8.0, 0.5], 0.25)],
                         ids=["plain", "factors_and_linear_scaling"])
def test_rope_gradient_and_values(mode, dims, factors, freq_scale):
    rng = np.random.default_rng(5)
    g = Graph()
    x = g.param("x", rnd(rng, 2, 3, 2, 8))
    pos = g.input("pos", (2, 3), "i32")
    posv = np.array([[0, 1, 2], [5, 9, 3]], np.int32)
    ff = None if factors is None else g.const("rope_freqs", np.array(factors[:dims // 2]))
    y = ops.rope(x, pos, dims=dims, base=500.0, mode=mode, freq_factors=ff,
                 freq_scale=freq_scale)
    assert check_gradients(g, weighted_sum(y, rng), [x], {pos: posv}) <= TOL
    # Values: rotate every pair by hand (y was marked as an output before realize), at
    # theta_i = freq_scale * p * base^(-2i/dims) / factors[i] as in ggml.
    g.output(y)
    s = Session(g, dtype="f64"); s.realize(); s.upload(pos, posv); s.run("forward")
    out, xv = s.download(y), g.find("x").data.astype(np.float64)
    for i in range(dims // 2):
        f = 1.0 if factors is None else factors[i]
        theta = freq_scale * posv[..., None] * 500.0 ** (-2 * i / dims) / f
        i0, i1 = (2 * i, 2 * i + 1) if mode == "normal" else (i, i + dims // 2)
        x0, x1 = xv[..., i0], xv[..., i1]
        np.testing.assert_allclose(out[..., i0], x0 * np.cos(theta) - x1 * np.sin(theta),
                                   rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out[..., i1], x0 * np.sin(theta) + x1 * np.cos(theta),
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out[..., dims:], xv[..., dims:])  # past dims: untouched


def test_get_rows_gradient_with_repeats():
    rng = np.random.default_rng(6)
    g = Graph()
    table = g.param("table", rnd(rng, 7, 3))
    ids = g.input("ids", (2, 4), "i32")
    y = ops.get_rows(table, ids)
    idv = np.array([[0, 3, 3, 6], [1, 0, 3, 2]], np.int32)
    assert check_gradients(g, weighted_sum(y, rng), [table], {ids: idv}) <= TOL


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_gradient_with_ignored(reduction):
    rng = np.random.default_rng(7)
    g = Graph()
    logits = g.param("logits", rnd(rng, 5, 6, s=2.0))
    lab = g.input("lab", (5,), "i32")
    loss = ops.cross_entropy(logits, lab, reduction=reduction)
    labv = np.array([1, -1, 5, 0, -1], np.int32)
    assert check_gradients(g, loss, [logits], {lab: labv}) <= TOL


def test_cross_entropy_values_and_all_ignored():
    rng = np.random.default_rng(8)
    lv = rnd(rng, 4, 5)
    labv = np.array([2, -1, 0, 4], np.int32)
    g = Graph()
    logits = g.param("logits", lv)
    lab = g.input("lab", (4,), "i32")
    loss = g.output(ops.cross_entropy(logits, lab))
    from toygraph.autodiff import accumulate_grads, backward
    accumulate_grads(backward(loss, [logits]))
    s = Session(g, dtype="f64"); s.realize(); s.reset()
    s.upload(lab, labv); s.run("backward")
    lp = lv - np.log(np.exp(lv).sum(1, keepdims=True))
    want = -np.mean([lp[0, 2], lp[2, 0], lp[3, 4]])
    assert np.isclose(float(s.download(loss)), want, rtol=1e-6)
    s.reset(); s.upload(lab, np.full(4, -1, np.int32)); s.run("backward")
    assert float(s.download(loss)) == 0.0
    assert not np.any(s.download(g.find("grad.logits")))


def test_composite_attention_block_gradient():
    """Q/K/V projections, rope, grouped-query causal attention, output projection."""
    rng = np.random.default_rng(9)
    B, T, D, H, KV, hd = 2, 4, 8, 4, 2, 2
    g = Graph()
    x = g.param("x", rnd(rng, B, T, D))
    wq, wk = g.param("wq", rnd(rng, H * hd, D, s=0.5)), g.param("wk", rnd(rng, KV * hd, D, s=0.5))
    wv, wo = g.param("wv", rnd(rng, KV * hd, D, s=0.5)), g.param("wo", rnd(rng, D, H * hd, s=0.5))
    pos = g.input("pos", (B, T), "i32")
    xn = ops.rms_norm(x, 1e-5)
    q = ops.matmul(xn, wq, trans_b=True).reshape(B, T, H, hd).rope(pos, hd, 10000.0)
    k = ops.matmul(xn, wk, trans_b=True).reshape(B, T, KV, hd).rope(pos, hd, 10000.0)
    v = ops.matmul(xn, wv, trans_b=True).reshape(B, T, KV, hd)
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    att = ops.matmul(q, k, trans_b=True).softmax(scale=hd ** -0.5, causal=True)
    o = ops.matmul(att, v).permute(0, 2, 1, 3).reshape(B, T, H * hd)
    y = ops.matmul(o, wo, trans_b=True) + x
    posv = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    err = check_gradients(g, weighted_sum(y, rng), [x, wq, wk, wv, wo], {pos: posv})
    assert err <= TOL


# --- fused attention -------------------------------------------------------------------------
ATTN_CASES = [  # (B, H, KV, T, hd, causal)
    (2, 4, 4, 5, 3, True), (2, 4, 4, 5, 3, False),       # one K/V head per query head
    (2, 6, 2, 5, 4, True), (1, 6, 2, 6, 4, False),       # grouped-query: 3 query heads per kv
    (1, 3, 1, 7, 2, True),                               # multi-query
]


@pytest.fixture(params=[256, 2], ids=["one_block", "query_blocks_of_2"])
def attn_rows(request, monkeypatch):
    """The numpy kernels' query-block size: the default, and 2 rows so that T splits into
    several blocks (and a ragged last one) even in these small tests."""
    from toygraph.cpu import fused
    monkeypatch.setattr(fused, "ATTN_ROWS", request.param)
    return request.param


def _attn_inputs(rng, B, H, KV, T, hd):
    return rnd(rng, B, H, T, hd), rnd(rng, B, KV, T, hd), rnd(rng, B, KV, T, hd)


# Sliding-window causal attention (Gemma 3): query i sees key j iff j <= i and i - j < window.
WINDOW_CASES = [  # (B, H, KV, T, hd, window)
    (2, 4, 4, 5, 3, 2), (2, 6, 2, 7, 4, 3),              # grouped-query, ragged blocks
    (1, 3, 1, 7, 2, 1),                                  # window 1: each query sees itself
    (1, 4, 2, 6, 3, 6), (1, 4, 2, 5, 3, 9),              # window >= T: plain causal
]


@pytest.mark.parametrize("B,H,KV,T,hd,causal,window",
                         [c + (0,) for c in ATTN_CASES] +
                         [c[:5] + (True, c[5]) for c in WINDOW_CASES])
def test_attention_gradients(B, H, KV, T, hd, causal, window, attn_rows):
    rng = np.random.default_rng(11)
    g = Graph()
    q, k, v = (g.param(n, x) for n, x in zip("qkv", _attn_inputs(rng, B, H, KV, T, hd)))
    y = ops.attention(q, k, v, scale=hd ** -0.5, causal=causal, window=window)
    # With window 1 the output is v itself: q and k get exactly no gradient, and a relative
    # error against an all-zero finite difference means nothing (the comparison with the
    # explicitly masked softmax in test_ops_llama3_gemma3.py checks dq = dk = 0 there).
    params = [v] if window == 1 else [q, k, v]
    assert check_gradients(g, weighted_sum(y, rng), params, {}) <= TOL


def assert_attention_matches(vals, fused, unfused, seed=12):
    """Forward value and all three gradients of ``fused(q, k, v)`` against
    ``unfused(q, k, v)`` in f64, to 1e-12 of the largest reference value (or of 1, where
    a gradient is exactly zero)."""
    from toygraph.autodiff import accumulate_grads, backward
    r = np.random.default_rng(seed).normal(size=vals[0].shape)
    results = []
    for build in (fused, unfused):
        g = Graph()
        q, k, v = (g.param(n, x) for n, x in zip("qkv", vals))
        y = g.output(build(q, k, v))
        loss = g.output(ops.sum(ops.mul(y, g.const("r", r))))
        accumulate_grads(backward(loss, [q, k, v]))
        s = Session(g, dtype="f64"); s.realize(); s.reset(); s.run("backward")
        results.append([s.download(y)] + [s.download(g.find(f"grad.{n}")) for n in "qkv"])
    for what, a, b in zip(["output", "dq", "dk", "dv"], *results):
        assert np.abs(a - b).max() <= 1e-12 * max(np.abs(b).max(), 1.0), what


@pytest.mark.parametrize("B,H,KV,T,hd,causal", ATTN_CASES + [(2, 6, 3, 40, 8, True)])
def test_attention_equals_the_unfused_composition(B, H, KV, T, hd, causal, attn_rows):
    """Forward value and all three gradients against matmul -> softmax -> matmul (f64)."""
    def unfused(q, k, v):
        return ops.matmul(ops.matmul(q, k, trans_b=True).softmax(scale=0.3, causal=causal), v)
    assert_attention_matches(_attn_inputs(np.random.default_rng(12), B, H, KV, T, hd),
                             lambda q, k, v: ops.attention(q, k, v, scale=0.3, causal=causal),
                             unfused)


def test_attention_backward_is_one_node_read_through_three_unpacks():
    from toygraph.autodiff import backward
    rng = np.random.default_rng(13)
    g = Graph()
    q, k, v = (g.param(n, x) for n, x in zip("qkv", _attn_inputs(rng, 2, 6, 2, 5, 4)))
    y = ops.attention(q, k, v, scale=0.5)
    grads = backward(ops.sum(y), [q, k, v])
    assert [t.op for t in grads.values()] == ["unpack"] * 3
    back = {t.srcs[0] for t in grads.values()}
    assert len(back) == 1 and next(iter(back)).op == "attention_back"
    assert [t.attrs["offset"] for t in grads.values()] == [0, q.size, q.size + k.size]
    assert next(iter(back)).shape == (q.size + k.size + v.size,)


def test_unpack_values_and_errors():
    g = Graph()
    x = g.const("x", np.arange(10.0))
    y = g.output(ops.unpack(x, 3, (2, 3)))
    s = Session(g, dtype="f64"); s.realize(); s.run("forward")
    np.testing.assert_array_equal(s.download(y), np.arange(3.0, 9.0).reshape(2, 3))
    with pytest.raises(GraphError, match="unpack.*outside"):
        ops.unpack(x, 5, (2, 3))


def test_attention_shape_errors():
    g = Graph()
    q, k = g.input("q", (2, 6, 5, 4)), g.input("k", (2, 4, 5, 4))
    with pytest.raises(GraphError, match="attention.*multiple of kv heads"):
        ops.attention(q, k, k, scale=1.0)
    k2 = g.input("k2", (2, 2, 5, 4))
    with pytest.raises(GraphError, match="must share a shape"):
        ops.attention(q, k2, g.input("v3", (2, 2, 5, 3)), scale=1.0)
    with pytest.raises(GraphError, match="batch, sequence and head_dim"):
        ops.attention(q, g.input("k4", (2, 2, 6, 4)), g.input("v4", (2, 2, 6, 4)), scale=1.0)
    with pytest.raises(GraphError, match="attention"):
        ops.attention(g.input("q3", (6, 5, 4)), k2, k2, scale=1.0)


def test_composite_two_layer_mlp_with_cross_entropy():
    rng = np.random.default_rng(10)
    g = Graph()
    x = g.input("x", (6, 4))
    lab = g.input("lab", (6,), "i32")
    w1, b1 = g.param("w1", rnd(rng, 4, 8)), g.param("b1", rnd(rng, 8))
    w2, b2 = g.param("w2", rnd(rng, 8, 3)), g.param("b2", rnd(rng, 3))
    logits = ops.silu(x @ w1 + b1) @ w2 + b2
    loss = ops.cross_entropy(logits, lab)
    err = check_gradients(g, loss, [w1, b1, w2, b2],
                          {x: rnd(rng, 6, 4), lab: np.array([0, 2, 1, -1, 2, 0], np.int32)})
    assert err <= TOL


# --- build-time checks ---------------------------------------------------------------------
def test_shape_errors_name_op_and_operands():
    g = Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (5, 6))
    with pytest.raises(GraphError, match=r"matmul\(a \(3, 4\) f32, b \(5, 6\) f32\): inner"):
        a @ b
    with pytest.raises(GraphError, match="add.*do not broadcast"):
        a + b
    ids = g.input("ids", (3,), "i32")
    with pytest.raises(GraphError, match="get_rows"):
        ops.get_rows(ids, a)
    with pytest.raises(GraphError, match="reshape"):
        a.reshape(5, 3)
    with pytest.raises(GraphError, match="causal"):
        ops.softmax(a, causal=True)
    with pytest.raises(GraphError, match="rope"):
        ops.rope(a, ids, dims=4, base=1e4)
    with pytest.raises(GraphError, match="already exists"):
        g.input("a", (1,))
    with pytest.raises(GraphError, match="dtype"):
        g.input("c", (1,), "f16")


# --- fused output head + cross-entropy ------------------------------------------------------------
LCE_LABELS = {  # N = 7 rows over a vocabulary of 9
    "some_ignored": [1, -1, 8, 0, -1, 3, 3],
    "none_ignored": [2, 5, 0, 8, 1, 1, 4],
    "all_ignored": [-1] * 7,
}


@pytest.fixture(params=[128, 2], ids=["one_chunk", "chunks_of_2"])
def lce_rows(request, monkeypatch):
    """The numpy kernels' chunk size: the default, and 2 rows, so the rows split into
    several chunks (and a ragged last one) even here."""
    from toygraph.cpu import fused
    monkeypatch.setattr(fused, "LCE_ROWS", request.param)
    return request.param


@pytest.mark.parametrize("labels", list(LCE_LABELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_gradients(reduction, labels, lce_rows):
    rng = np.random.default_rng(21)
    g = Graph()
    h, w = g.param("h", rnd(rng, 7, 5)), g.param("w", rnd(rng, 9, 5))
    lab = g.input("lab", (7,), "i32")
    loss = ops.linear_cross_entropy(h, w, lab, reduction=reduction)
    labv = np.array(LCE_LABELS[labels], np.int32)
    err = check_gradients(g, loss, [h, w], {lab: labv})
    if labels == "all_ignored":
        assert err == 0.0   # zero loss, zero gradients, zero finite differences
    else:
        assert err <= TOL


def _lce_run(fused, hv, wv, labv, reduction, params=("h", "w")):
    from toygraph.autodiff import accumulate_grads, backward
    g = Graph()
    h = g.param("h", hv) if "h" in params else g.const("h", hv)
    w = g.param("w", wv) if "w" in params else g.const("w", wv)
    lab = g.input("lab", labv.shape, "i32")
    if fused:
        loss = ops.linear_cross_entropy(h, w, lab, reduction=reduction)
    else:
        loss = ops.cross_entropy(ops.matmul(h, w, trans_b=True), lab, reduction=reduction)
    g.output(loss)
    ps = [t for t in (h, w) if t.role == "param"]
    accumulate_grads(backward(loss, ps))
    s = Session(g, dtype="f64"); s.realize(); s.reset()
    s.upload(lab, labv); s.run("backward")
    return g, [s.download(loss)] + [s.download(g.find(f"grad.{p.name}")) for p in ps]


@pytest.mark.parametrize("labels", list(LCE_LABELS) + ["long"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_equals_the_unfused_head(reduction, labels, lce_rows):
    """Loss, dh and dw against cross_entropy(matmul(h, w^T)) in f64, within 1e-12."""
    rng = np.random.default_rng(22)
    N = 150 if labels == "long" else 7
    hv, wv = rng.normal(size=(N, 6)), rng.normal(size=(11, 6)) * 2
    labv = (rng.integers(-1, 11, size=N) if labels == "long"
            else np.minimum(LCE_LABELS[labels], 10)).astype(np.int32)
    _, fused = _lce_run(True, hv, wv, labv, reduction)
    _, plain = _lce_run(False, hv, wv, labv, reduction)
    for what, a, b in zip(["loss", "dh", "dw"], fused, plain):
        assert np.abs(a - b).max() <= 1e-12 * max(np.abs(b).max(), 1.0), what
    if labels == "all_ignored":
        assert float(fused[0]) == 0.0 and not fused[1].any() and not fused[2].any()


def test_linear_cross_entropy_backward_packs_dw_only_when_w_trains():
    """A frozen head (LoRA) gets no dw: the backward node holds dh alone."""
    from toygraph.autodiff import backward
    rng = np.random.default_rng(23)
    for trainable in (("h", "w"), ("h",), ("w",)):
        g = Graph()
        h = g.param("h", rnd(rng, 7, 5)) if "h" in trainable else g.const("h", rnd(rng, 7, 5))
        w = g.param("w", rnd(rng, 9, 5)) if "w" in trainable else g.const("w", rnd(rng, 9, 5))
        lab = g.input("lab", (7,), "i32")
        ps = [t for t in (h, w) if t.role == "param"]
        grads = backward(ops.linear_cross_entropy(h, w, lab), ps)
        backs = {t.srcs[0] for t in grads.values()}
        assert [t.op for t in grads.values()] == ["unpack"] * len(ps)
        (back,) = backs
        assert back.op == "linear_cross_entropy_back"
        assert back.shape == (sum(p.size for p in ps),)
        assert (back.attrs["grad_h"], back.attrs["grad_w"]) == ("h" in trainable, "w" in trainable)
        assert [t.attrs["offset"] for t in grads.values()] == [0, h.size][:len(ps)] \
            if len(ps) == 2 else [0]
    # LoRA-style: only dh, and the values still match the unfused head.
    hv, wv = rng.normal(size=(7, 5)), rng.normal(size=(9, 5))
    labv = np.array(LCE_LABELS["some_ignored"], np.int32)
    _, fused = _lce_run(True, hv, wv, labv, "sum", params=("h",))
    _, plain = _lce_run(False, hv, wv, labv, "sum", params=("h",))
    assert np.abs(fused[1] - plain[1]).max() <= 1e-12 * np.abs(plain[1]).max()


def test_linear_cross_entropy_never_builds_vocabulary_sized_rows(lce_rows, monkeypatch):
    """No array with N * V elements (or [N, V]) is made, forward or backward."""
    from toygraph.cpu import kernels
    N, D, V = 150, 4, 13
    seen = []
    real_matmul = np.matmul

    def spy(a, b, *args, **kw):
        r = real_matmul(a, b, *args, **kw)
        seen.append(np.shape(r))
        return r
    monkeypatch.setattr(kernels.np, "matmul", spy)
    rng = np.random.default_rng(24)
    _lce_run(True, rng.normal(size=(N, D)), rng.normal(size=(V, D)),
             rng.integers(0, V, size=N).astype(np.int32), "mean")
    assert seen and all(s[0] <= lce_rows for s in seen if s[-1] == V)


def test_linear_cross_entropy_shape_errors():
    g = Graph()
    h, w, lab = g.input("h", (4, 3)), g.input("w", (6, 3)), g.input("lab", (4,), "i32")
    with pytest.raises(GraphError, match="linear_cross_entropy.*h must be"):
        ops.linear_cross_entropy(h, g.input("w2", (6, 5)), lab)
    with pytest.raises(GraphError, match="labels must be"):
        ops.linear_cross_entropy(h, w, g.input("lab2", (5,), "i32"))
    with pytest.raises(GraphError, match="i32 labels"):
        ops.linear_cross_entropy(h, w, g.input("lab3", (4,)))
    with pytest.raises(GraphError, match="reduction"):
        ops.linear_cross_entropy(h, w, lab, reduction="none")


def test_linear_cross_entropy_labels_are_checked_at_upload():
    """-1 is allowed, a label at or past the head's vocabulary is refused on the host."""
    g = Graph()
    h, w = g.param("h", np.ones((3, 2), np.float32)), g.const("w", np.ones((5, 2)))
    lab = g.input("lab", (3,), "i32")
    g.output(ops.linear_cross_entropy(h, w, lab))
    s = Session(g); s.realize()
    s.upload(lab, np.array([-1, 0, 4], np.int32))
    with pytest.raises(GraphError, match=r"value 5 outside \[-1, 5\).*vocabulary"):
        s.upload(lab, np.array([0, 5, 1], np.int32))
