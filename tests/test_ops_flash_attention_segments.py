"""Fused attention with segment ids (sample packing): query i sees key j only when both
carry the same segment id, on top of causality and the sliding window. Checked against a
dense masked softmax written out here in numpy (f64), by finite differences, against the
numpy kernels run on each segment alone, and, for the CUDA kernels, on the host executor
(TOYGRAPH_CUDA_DEVICE=host) against numpy, with ragged segments across tile edges, both
layouts, and the row log-sum-exp the forward saves (f32 and bf16)."""
import numpy as np
import pytest

from support.gradcheck import check_gradients, weighted_sum
from support.hostparity import MIXED_TOL, REDUCTION, compare_op, rel_err, rnd, run_phase
from support.tcattn_reference import visible
from toygraph.core import ops
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.session import Session


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


def _run(vals, segs, scale, causal, window):
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
def attn_rows(request, monkeypatch):
    from toygraph.core.ops import flash_attention
    monkeypatch.setattr(flash_attention, "ATTN_ROWS", request.param)


CASES = [  # (B, H, KV, T, hd, causal, window)
    (2, 4, 2, 11, 3, True, 0), (2, 4, 4, 9, 3, False, 0), (1, 6, 2, 13, 4, True, 3),
    (3, 3, 1, 8, 2, True, 1),
]


@pytest.mark.parametrize("B,H,KV,T,hd,causal,window", CASES)
def test_segmented_attention_equals_the_dense_masked_softmax(B, H, KV, T, hd, causal, window,
                                                             attn_rows):
    rng = np.random.default_rng(1)
    vals = [rng.normal(size=s) for s in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))]
    segs = ragged_segments(rng, B, T)
    got = _run(vals, segs, 0.4, causal, window)
    want = dense_reference(*vals, segs, 0.4, causal, window)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_each_segment_equals_that_segment_alone():
    """Rows of one packed segment give exactly (f64, <= 1e-12) what the segment alone
    gives as a batch row of its own."""
    rng = np.random.default_rng(2)
    B, H, KV, T, hd = 2, 4, 2, 16, 4
    vals = [rng.normal(size=s) for s in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))]
    segs = ragged_segments(rng, B, T, pad=False)
    packed = _run(vals, segs, 0.5, True, 0)
    for b in range(B):
        for sid in np.unique(segs[b]):
            rows = np.flatnonzero(segs[b] == sid)
            alone = _run([x[b:b + 1, :, rows] for x in vals], np.zeros((1, len(rows)), np.int32),
                         0.5, True, 0)
            assert np.abs(packed[b:b + 1, :, rows] - alone).max() <= 1e-12


@pytest.mark.parametrize("B,H,KV,T,hd,causal,window", CASES)
def test_segmented_attention_gradients(B, H, KV, T, hd, causal, window, attn_rows):
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


# --- the CUDA kernels on the host executor --------------------------------------------------
@pytest.mark.parametrize("B,H,KV,T,hd,causal,window,layout", [
    (2, 4, 2, 37, 8, True, 0, "bhtd"),      # ragged segments across the 32-row tile edge
    (2, 4, 2, 37, 8, True, 0, "bthd"),      # the same token-major
    (1, 6, 2, 100, 16, True, 0, "bhtd"),    # many tiles: whole tiles skipped between segments
    (2, 2, 2, 45, 64, False, 0, "bhtd"),    # not causal: a segment still sees only itself
    (1, 4, 1, 70, 64, True, 20, "bhtd"),    # with a sliding window (Gemma 3)
    (1, 4, 1, 70, 64, True, 20, "bthd"),    # the same token-major
    (1, 2, 1, 35, 100, True, 0, "bthd"),    # the HD=128 kernels (16-row tiles)
])
def test_segmented_attention_on_the_host_executor_matches_numpy(B, H, KV, T, hd, causal,
                                                               window, layout, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")

    def segs(g, rng):
        return {g.input("segs", (B, T), "i32"): ragged_segments(rng, B, T)}
    shapes = [(B, T, n, hd) if layout == "bthd" else (B, n, T, hd) for n in (H, KV, KV)]
    compare_op(lambda q, k, v, s: ops.attention(q, k, v, scale=hd ** -0.5, causal=causal,
                                                window=window, segments=s, layout=layout),
               shapes, REDUCTION, inputs_fn=segs)


@pytest.mark.parametrize("precision,tol", [("f32", REDUCTION), ("bf16", MIXED_TOL["bf16"])])
@pytest.mark.parametrize("B,H,KV,T,hd,window,sinks,layout", [
    (2, 4, 2, 37, 16, 0, False, "bhtd"),    # GQA, T off the tile
    (2, 4, 2, 37, 16, 0, False, "bthd"),
    (1, 6, 2, 70, 64, 20, True, "bthd"),    # window and sinks across tile edges
    (1, 2, 1, 35, 100, 0, True, "bhtd"),    # hd below its bound (f32: HD 128)
])
def test_the_saved_row_log_sum_exp_matches_numpy_on_the_host(B, H, KV, T, hd, window, sinks,
                                                            layout, precision, tol,
                                                            monkeypatch):
    """The attention node's packed o and L (with ragged segments) from the host executor
    against numpy's: L is what the backward reads instead of recomputing it."""
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    rng = np.random.default_rng(7)
    g = Graph()
    shapes = [(B, T, n, hd) if layout == "bthd" else (B, n, T, hd) for n in (H, KV, KV)]
    q, k, v = (g.const(n, rnd(rng, *s)) for n, s in zip("qkv", shapes))
    sg = g.input("segs", (B, T), "i32")
    sk = g.const("sinks", rnd(rng, H)) if sinks else None
    o = ops.attention(q, k, v, scale=hd ** -0.5, window=window, segments=sg, sinks=sk,
                      layout=layout)
    att = g.output(o.srcs[0])
    ids = {sg: ragged_segments(rng, B, T)}
    want, = run_phase(g, "cpu", ids, "forward", [att])
    got, = run_phase(g, "cuda", ids, "forward", [att], precision)
    n = o.size
    assert rel_err(got[:n], want[:n]) <= tol, ("o", rel_err(got[:n], want[:n]))
    assert rel_err(got[n:], want[n:]) <= tol, ("L", rel_err(got[n:], want[n:]))


@pytest.mark.parametrize("B,H,KV,T,hd,causal,window", [
    (2, 4, 2, 37, 8, True, 0), (1, 6, 2, 100, 64, True, 0), (2, 3, 3, 50, 128, False, 0),
    (1, 4, 1, 70, 64, True, 20),
])
def test_segmented_launches_replayed_in_numpy_visit_only_live_tiles(B, H, KV, T, hd, causal,
                                                                   window):
    """test_ops_flash_attention_cuda's emulator follows the kernels' tile loops, skipping the tiles
    attn_tile_live rejects, and fails on any visited tile with nothing visible in it."""
    from test_ops_flash_attention_cuda import replay_attention_launches
    segs = ragged_segments(np.random.default_rng(4), B, T)
    replay_attention_launches(B, H, KV, T, hd, causal, window, segments=segs)
