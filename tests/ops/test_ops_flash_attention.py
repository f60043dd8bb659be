"""The fused attention op (ops/flash_attention/), numpy side: f64 finite-difference gradients
(grouped-query, causal, sliding window, both layouts; the numpy kernels in one query block
and in blocks of 2 rows), equality with the unfused softmax composition and with an
explicitly masked softmax, the saved row log-sum-exp, the token-major layout bit for bit
against heads-first, the packed backward read through unpack, and shape errors. With segment
ids (sample packing: query i sees key j only when both carry the same segment id, on top of
causality and the window): against a dense masked softmax written out here in f64, by finite
differences, and against each segment run alone."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, forward_f64, rnd, weighted_sum
from support.tcattn_reference import visible
from toygraph import ops
from toygraph.core.autodiff import backward
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.session import Session


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
    from toygraph.ops.flash_attention import numpy as flash_attention
    monkeypatch.setattr(flash_attention, "ATTN_ROWS", request.param)
    return request.param


def _attn_inputs(rng, B, H, KV, T, hd):
    return rnd(rng, B, H, T, hd), rnd(rng, B, KV, T, hd), rnd(rng, B, KV, T, hd)


# Sliding-window causal attention (Gemma 3): query i sees key j iff j <= i and i - j < window.
WINDOW_CASES = [  # (B, H, KV, T, hd, window)
    (2, 4, 4, 5, 3, 2), (2, 6, 2, 7, 4, 3),              # grouped-query, ragged blocks
    (1, 3, 1, 7, 2, 1),                                  # window 1: each query sees itself
    (1, 4, 2, 6, 3, 6), (1, 4, 2, 5, 3, 9),              # window >= T: plain causal
]


def _tokens_first(x):
    """[B, heads, T, hd] -> the token-major [B, T, heads, hd] (a copy)."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("B,H,KV,T,hd,causal,window",
                         [c + (0,) for c in ATTN_CASES] +
                         [c[:5] + (True, c[5]) for c in WINDOW_CASES])
def test_attention_gradients(B, H, KV, T, hd, causal, window, layout, attn_rows):
    rng = np.random.default_rng(11)
    vals = _attn_inputs(rng, B, H, KV, T, hd)
    if layout == "bthd":
        vals = [_tokens_first(x) for x in vals]
    g = Graph()
    q, k, v = (g.param(n, x) for n, x in zip("qkv", vals))
    y = ops.attention(q, k, v, scale=hd ** -0.5, causal=causal, window=window, layout=layout)
    # With window 1 the output is v itself: q and k get exactly no gradient, and a relative
    # error against an all-zero finite difference means nothing (the comparison with the
    # explicitly masked softmax below checks dq = dk = 0 there).
    params = [v] if window == 1 else [q, k, v]
    assert check_gradients(g, weighted_sum(y, rng), params, {}) <= TOL


def assert_attention_matches(vals, fused, unfused, seed=12):
    """Forward value and all three gradients of ``fused(q, k, v)`` against
    ``unfused(q, k, v)`` in f64, to 1e-12 of the largest reference value (or of 1, where
    a gradient is exactly zero)."""
    from toygraph.core.autodiff import accumulate_grads, backward
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


def _run_attention(vals, layout, segments=None, r=None, **kw):
    """o, L and (dq, dk, dv[, d sinks]) of ops.attention over ``vals`` (q, k, v[, sinks])
    as params with the loss sum(o * r) (r random unless given), on the numpy backend
    (f32); ``segments`` [B, T] ids are uploaded to an input."""
    from toygraph.core.autodiff import accumulate_grads, backward
    g = Graph()
    params = [g.param(n, x) for n, x in zip(("q", "k", "v", "sinks"), vals)]
    seg = None if segments is None else g.input("segs", segments.shape, "i32")
    o = ops.attention(*params[:3], sinks=params[3] if len(params) > 3 else None,
                      segments=seg, layout=layout, **kw)
    if r is None:
        r = np.random.default_rng(0).normal(size=o.shape).astype(np.float32)
    outs = [g.output(o), g.output(o.srcs[0])]
    grads = accumulate_grads(backward(ops.sum(ops.mul(o, g.const("r", r))), params))
    s = Session(g)
    s.realize()
    s.reset()
    if seg is not None:
        s.upload(seg, segments)
    s.run("backward")
    o_val, packed = (s.download(t) for t in outs)
    return o_val, packed[o.size:], [s.download(grads[p]) for p in params]


@pytest.mark.parametrize("sinks,segmented,window", [(False, False, 0), (True, False, 4),
                                                    (False, True, 0), (True, True, 3)])
def test_token_major_layout_equals_heads_first_bit_for_bit(sinks, segmented, window, attn_rows):
    """o, L and every gradient of the token-major op are the heads-first op's, moved
    (numpy f32: the kernels copy token-major operands heads first, so every product sees
    the same arrays): the decoder's switch to token-major changes no bit of a numpy run."""
    rng = np.random.default_rng(21)
    B, H, KV, T, hd = 2, 6, 2, 11, 4
    vals = list(_attn_inputs(rng, B, H, KV, T, hd)) + ([rnd(rng, H)] if sinks else [])
    segs = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 0]],
                    np.int32) if segmented else None
    r = rnd(rng, B, H, T, hd)
    o1, l1, g1 = _run_attention(vals, "bhtd", segs, r, scale=0.4, window=window)
    moved = [_tokens_first(x) if x.ndim == 4 else x for x in vals]
    o2, l2, g2 = _run_attention(moved, "bthd", segs, _tokens_first(r), scale=0.4, window=window)
    np.testing.assert_array_equal(o2, _tokens_first(o1))
    np.testing.assert_array_equal(l2, l1)
    for a, b in zip(g2, g1):
        np.testing.assert_array_equal(a, _tokens_first(b) if b.ndim == 4 else b)


@pytest.mark.parametrize("sinks,window", [(False, 0), (True, 0), (True, 3), (False, 2)])
def test_the_node_saves_the_row_log_sum_exp(sinks, window, attn_rows):
    """L [B, H, T] after o: log of each row's softmax denominator of the scaled, masked
    scores (the sink's logit included), against f64 numpy."""
    rng = np.random.default_rng(22)
    B, H, KV, T, hd = 2, 4, 2, 7, 3
    q, k, v = _attn_inputs(rng, B, H, KV, T, hd)
    sk = rnd(rng, H) if sinks else None
    _, lse, _ = _run_attention([q, k, v] + ([sk] if sinks else []), "bhtd", scale=0.5,
                               window=window)
    s = 0.5 * q.astype(np.float64) @ np.swapaxes(np.repeat(k, H // KV, 1), -1, -2)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= i) & ((i - j < window) if window else True), s, -np.inf)
    if sinks:
        s = np.concatenate([s, np.broadcast_to(sk[None, :, None, None], (B, H, T, 1))], -1)
    want = np.log(np.exp(s).sum(-1))
    np.testing.assert_allclose(lse.reshape(B, H, T), want, rtol=1e-6, atol=1e-6)


def test_a_forward_only_node_leaves_l_out_and_has_no_gradient():
    g = Graph()
    q = g.param("q", np.ones((1, 2, 5, 4), np.float32))
    o = ops.attention(q, q, q, scale=0.5, save_lse=False)
    assert o.srcs[0].shape == (q.size,) and ops.attention(q, q, q, scale=0.5).srcs[0].shape == (
        q.size + 2 * 5,)
    with pytest.raises(GraphError, match="save_lse=False.*no gradient"):
        backward(ops.sum(o), [q])


def test_only_o_has_a_gradient():
    """L is statistics the backward reads, not a differentiable output; the packed node is
    read through its views only."""
    g = Graph()
    q = g.param("q", np.ones((1, 2, 5, 4), np.float32))
    att = ops.attention(q, q, q, scale=0.5).srcs[0]
    lse = ops.unpack(att, q.size, (1, 2, 5))
    with pytest.raises(GraphError, match="only its output o has a gradient"):
        backward(ops.sum(lse), [q])
    with pytest.raises(GraphError, match="must be read through unpack views"):
        backward(ops.sum(att), [q])


def test_attention_backward_is_one_node_read_through_three_unpacks():
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


# --- sliding-window attention -----------------------------------------------------------------
def _window_mask(T, window):
    """The additive mask: 0 where query i sees key j (j <= i, i - j < window), else -inf."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    return np.where((j <= i) & (i - j < window), 0.0, -np.inf)


@pytest.mark.parametrize("B,H,KV,T,hd,window", WINDOW_CASES + [(2, 6, 3, 40, 8, 7)])
def test_windowed_attention_equals_an_explicitly_masked_softmax(B, H, KV, T, hd, window,
                                                                attn_rows):
    """Forward value and all three gradients against matmul -> + mask -> softmax -> matmul
    (f64); at window 1, dq = dk = 0."""
    def unfused(q, k, v):
        scores = ops.matmul(q, k, trans_b=True) + q.graph.const("mask", _window_mask(T, window))
        return ops.matmul(scores.softmax(scale=0.3), v)
    assert_attention_matches(_attn_inputs(np.random.default_rng(26), B, H, KV, T, hd),
                             lambda q, k, v: ops.attention(q, k, v, scale=0.3, window=window),
                             unfused, seed=26)


def test_window_at_least_t_is_plain_causal_bit_for_bit(attn_rows):
    rng = np.random.default_rng(27)
    g = Graph()
    q, k, v = (g.const(n, x) for n, x in zip("qkv", _attn_inputs(rng, 2, 6, 2, 9, 4)))
    outs = [g.output(ops.attention(q, k, v, scale=0.4, window=w)) for w in (0, 9, 50)]
    s = forward_f64(g)
    np.testing.assert_array_equal(s.download(outs[0]), s.download(outs[1]))
    np.testing.assert_array_equal(s.download(outs[0]), s.download(outs[2]))


def test_window_errors():
    g = Graph()
    q = g.input("q", (1, 2, 5, 4))
    with pytest.raises(GraphError, match="attention.*sliding window needs causal=True"):
        ops.attention(q, q, q, scale=1.0, causal=False, window=3)
    with pytest.raises(GraphError, match="attention.*window must be >= 0"):
        ops.attention(q, q, q, scale=1.0, window=-1)


# --- attention sinks (gpt-oss) ---------------------------------------------------------------
@pytest.mark.parametrize("B,H,KV,T,hd,window", [(2, 4, 2, 5, 3, 0), (1, 6, 2, 7, 4, 3),
                                                (1, 3, 1, 6, 2, 0)])
def test_attention_sinks_gradients(B, H, KV, T, hd, window, attn_rows):
    """q, k, v and the sinks themselves against f64 central differences."""
    rng = np.random.default_rng(13)
    g = Graph()
    q, k, v = (g.param(n, x) for n, x in zip("qkv", _attn_inputs(rng, B, H, KV, T, hd)))
    sinks = g.param("sinks", rnd(rng, H))
    y = ops.attention(q, k, v, scale=hd ** -0.5, window=window, sinks=sinks)
    assert check_gradients(g, weighted_sum(y, rng), [q, k, v, sinks], {}) <= TOL


def test_attention_sinks_are_a_zero_value_key_in_the_softmax(attn_rows):
    """The fused op equals transformers' GptOssAttention composition: the sink logit
    concatenated to the masked scores, softmax, the sink column dropped, times v."""
    rng = np.random.default_rng(14)
    B, H, KV, T, hd, window = 2, 4, 2, 6, 3, 4
    qv, kv, vv = (x.astype(np.float64) for x in _attn_inputs(rng, B, H, KV, T, hd))
    sv = rnd(rng, H, s=2.0).astype(np.float64)
    g = Graph()
    y = g.output(ops.attention(g.const("q", qv), g.const("k", kv), g.const("v", vv),
                               scale=0.5, window=window, sinks=g.const("s", sv)))
    got = forward_f64(g).download(y)
    kr, vr = (np.repeat(x, H // KV, axis=1) for x in (kv, vv))
    s = qv @ np.swapaxes(kr, -1, -2) * 0.5
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= i) & (i - j < window), s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(sv[None, :, None, None], (B, H, T, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, p[..., :-1] @ vr, rtol=1e-12)
    assert p[..., -1].min() > 1e-3   # the sinks take a visible share of every row


def test_sinks_must_be_one_per_query_head():
    g = Graph()
    q, k = g.const("q", np.zeros((1, 4, 3, 2))), g.const("k", np.zeros((1, 2, 3, 2)))
    with pytest.raises(GraphError, match=r"sinks must be f32 \[heads\] = \[4\]"):
        ops.attention(q, k, k, scale=1.0, sinks=g.const("s", np.zeros(2)))


# --- segment ids (sample packing) --------------------------------------------------------
def ragged_segments(rng, B, T, pad=True):
    """[B, T] i32: each row cut into segments of random lengths 1..T/2, ids counting up
    from 1, and (``pad``) a tail of padding in segment 0."""
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        end = T - (int(rng.integers(0, T // 4 + 1)) if pad else 0)
        i, sid = 0, 1
        while i < end:
            n = min(int(rng.integers(1, max(2, T // 2))), end - i)
            out[b, i:i + n] = sid
            i, sid = i + n, sid + 1
    return out


def dense_reference(q, k, v, segs, scale, causal, window):
    """softmax(scale * q k^T + mask) v with the [T, T] mask built explicitly (f64)."""
    B, H, T, _ = q.shape
    G = H // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    vis = visible(T, causal, window, segs)                             # [B, T, T]
    s = np.where(vis[:, None], scale * q @ np.swapaxes(kk, -1, -2), -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ vv


def _run_segmented(vals, segs, scale, causal, window):
    g = Graph()
    q, k, v = (g.const(n, x) for n, x in zip("qkv", vals))
    sg = g.input("segs", segs.shape, "i32")
    y = g.output(ops.attention(q, k, v, scale=scale, causal=causal, window=window,
                               segments=sg))
    s = Session(g, dtype="f64")
    s.realize()
    s.upload(sg, segs)
    s.run("forward")
    return s.download(y)


@pytest.fixture(params=[256, 3], ids=["one_block", "query_blocks_of_3"])
def seg_attn_rows(request, monkeypatch):
    """Query blocks of 3 rows: segments of these lengths cross block edges."""
    from toygraph.ops.flash_attention import numpy as flash_attention
    monkeypatch.setattr(flash_attention, "ATTN_ROWS", request.param)


SEGMENT_CASES = [  # (B, H, KV, T, hd, causal, window)
    (2, 4, 2, 11, 3, True, 0), (2, 4, 4, 9, 3, False, 0), (1, 6, 2, 13, 4, True, 3),
    (3, 3, 1, 8, 2, True, 1),
]


@pytest.mark.parametrize("B,H,KV,T,hd,causal,window", SEGMENT_CASES)
def test_segmented_attention_equals_the_dense_masked_softmax(B, H, KV, T, hd, causal, window,
                                                             seg_attn_rows):
    rng = np.random.default_rng(1)
    vals = [rng.normal(size=s) for s in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))]
    segs = ragged_segments(rng, B, T)
    got = _run_segmented(vals, segs, 0.4, causal, window)
    want = dense_reference(*vals, segs, 0.4, causal, window)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_each_segment_equals_that_segment_alone():
    """Rows of one packed segment give exactly (f64, <= 1e-12) what the segment alone
    gives as a batch row of its own."""
    rng = np.random.default_rng(2)
    B, H, KV, T, hd = 2, 4, 2, 16, 4
    vals = [rng.normal(size=s) for s in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))]
    segs = ragged_segments(rng, B, T, pad=False)
    packed = _run_segmented(vals, segs, 0.5, True, 0)
    for b in range(B):
        for sid in np.unique(segs[b]):
            rows = np.flatnonzero(segs[b] == sid)
            alone = _run_segmented([x[b:b + 1, :, rows] for x in vals], np.zeros((1, len(rows)), np.int32),
                         0.5, True, 0)
            assert np.abs(packed[b:b + 1, :, rows] - alone).max() <= 1e-12


@pytest.mark.parametrize("B,H,KV,T,hd,causal,window", SEGMENT_CASES)
def test_segmented_attention_gradients(B, H, KV, T, hd, causal, window, seg_attn_rows):
    """Finite differences (f64) of q, k and v through segment-masked attention."""
    rng = np.random.default_rng(3)
    g = Graph()
    q, k, v = (g.param(n, rng.normal(size=s)) for n, s in
               zip("qkv", ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))))
    sg = g.input("segs", (B, T), "i32")
    y = ops.attention(q, k, v, scale=hd ** -0.5, causal=causal, window=window, segments=sg)
    params = [v] if window == 1 else [q, k, v]
    err = check_gradients(g, weighted_sum(y, rng), params, {sg: ragged_segments(rng, B, T)})
    assert err <= 1e-7


def test_segment_ids_are_checked():
    g = Graph()
    q = g.input("q", (2, 4, 5, 3))
    with pytest.raises(GraphError, match="segment ids must be \\[B, T\\]"):
        ops.attention(q, q, q, scale=1.0, segments=g.input("s", (2, 4), "i32"))
    with pytest.raises(GraphError, match="segment ids must be i32"):
        ops.attention(q, q, q, scale=1.0, segments=g.input("f", (2, 5)))
    sg = g.input("segs", (2, 5), "i32")
    g.output(ops.attention(q, q, q, scale=1.0, segments=sg))
    s = Session(g)
    s.realize()
    with pytest.raises(GraphError, match="upload 'segs': value -1 outside .*segment ids"):
        s.upload(sg, np.full((2, 5), -1, np.int32))
