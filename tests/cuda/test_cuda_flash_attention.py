"""The fused attention op's CUDA side (ops/flash_attention/, flash_attention.cu): the tiled
algorithm of every launch replayed in numpy (following the kernels' tile loop bounds,
failing on any visited tile with nothing visible in it) against the numpy kernels, with
grouped-query heads, every head_dim bound, sliding windows and both layouts; the head-dim
selection, the instantiated tiles, and the compiled kernels' register use. With segment ids
(sample packing), on the host executor (TOYGRAPH_CUDA_DEVICE=host) against numpy: ragged
segments across tile edges, both layouts, and the row log-sum-exp the forward saves (f32 and
bf16); the replayed launches visit only live tiles."""
import re

import numpy as np
import pytest

from support.cudaemu import needs_nvrtc, resolve
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.ops.lowering import constants, dispatch
from support.kernelsrc import KERNEL_NAMES
from support.kernelsrc import OP_KERNELS
from toygraph.ops.lowering.constants import ATTN_HEAD_DIMS
from toygraph.ops.lowering.sources import read_source
from toygraph.errors import CudaError
from toygraph.core.graph import Graph
from toygraph.ops import KERNELS as CPU_KERNELS
from toygraph.ops import flash_attention as attention_ops
from toygraph.ops.flash_attention import cuda as attention_cuda
from support.hostparity import MIXED_TOL, REDUCTION, compare_op, rel_err, rnd, run_phase
from test_ops_flash_attention import ragged_segments
from support.ptxas import ARCHS  # noqa: E402


def _attn_tile(mem, addr, r0, T, hd, BT, HD, ld):
    """Rows [r0, r0 + BT) of the [T, hd] matrix at ``addr`` with row stride ``ld``,
    zero-filled to [BT, HD]."""
    arr, off = resolve(mem, addr)
    out = np.zeros((BT, HD))
    for r in range(max(0, min(BT, T - r0))):
        out[r, :hd] = arr[off + (r0 + r) * ld:off + (r0 + r) * ld + hd]
    return out


def _head(b, h, heads, T, hd, tok):
    """Element offset of head h of batch row b and its row stride (attn_head, attn_ld)."""
    return (b * heads * T + (h if tok else h * T)) * hd, (heads * hd if tok else hd)


# One function of ~140 lines on purpose: it follows flash_attention.cu's four kernels
# branch by branch, loop by loop, so the two read side by side.
def _emulate_attention(launch, mem):
    """Replay one attention launch block by block with the kernel's own loop bounds, tiles,
    online softmax, strides, scratch layout and output addresses (numpy, f64)."""
    name = launch.kernel
    if name == "tg_attn_bwd_sinks":
        _emulate_sinks_gradient(launch, mem)
        return
    HD = int(name.rsplit("_", 1)[1])
    BT, TPR = constants.ATTN_TILES[HD]
    assert launch.block == (BT * TPR, 1, 1)
    a = [x[0] for x in launch.args]
    gx, gy, gz = launch.grid
    if name.startswith("tg_attn_bwd_prep_"):   # D = rowsum(dO * O) only: L is the forward's
        delta, o, g = (int(x) for x in a[:3])
        H, T, hd, tok = (int(x) for x in a[3:])
        assert (gx, gy) == ((T + BT - 1) // BT, H)
        D, Do = resolve(mem, delta)
        for b in range(gz):
            for h in range(H):
                at, ld = _head(b, h, H, T, hd, tok)
                O = _attn_tile(mem, o + 4 * at, 0, T, hd, T, hd, ld)
                dO = _attn_tile(mem, g + 4 * at, 0, T, hd, T, hd, ld)
                D[Do + (b * H + h) * T:Do + (b * H + h + 1) * T] = (O * dO).sum(1)
        return
    H, KV, T, hd, scale, causal, window, tok = (int(a[-8]), int(a[-7]), int(a[-6]), int(a[-5]),
                                                float(a[-4]), int(a[-3]), int(a[-2]), int(a[-1]))
    # Pointers end with the segment ids (or 0), then, in the forward, the sinks (or 0).
    *ptrs, seg_addr = [int(x) for x in a[:-8]]
    sinks = None
    if name.startswith("tg_attn_fwd_"):
        *ptrs, seg_addr, sink_addr = ptrs + [seg_addr]
        if sink_addr:
            arr, off = resolve(mem, sink_addr)
            sinks = arr[off:off + H]
    G, nt = H // KV, (T + BT - 1) // BT
    ar = np.arange(BT)
    segs = None
    if seg_addr:
        arr, off = resolve(mem, seg_addr)
        segs = np.concatenate([arr[off:off + gz * T].reshape(gz, T), np.zeros((gz, BT))], 1)

    def visible(i0, j0, b):
        i, j = i0 + ar[:, None], j0 + ar[None, :]
        vis = (i < T) & (j < T) & ((j <= i) if causal else True)
        if segs is not None:   # attn_same_seg
            vis = vis & (segs[b, i0:i0 + BT][:, None] == segs[b, j0:j0 + BT][None, :])
        return vis & (i - j < window) if window else vis

    def key_tiles(qt, b):  # the kernels' tile loop bounds (attn_first_key_tile and causal
        first = max(0, qt * BT - window + 1) // BT if window else 0   # last; attn_tile_live)
        return [kt for kt in range(first, (qt if causal else nt - 1) + 1)
                if segs is None or visible(qt * BT, kt * BT, b).any()]

    def query_tiles(kt, b):  # attn_last_query_tile, attn_tile_live
        last = min(nt - 1, (kt * BT + BT - 1 + window - 1) // BT) if window else nt - 1
        return [qt for qt in range(kt if causal else 0, last + 1)
                if segs is None or visible(qt * BT, kt * BT, b).any()]

    def tile_pair(i0, j0, b):  # a tile pair the kernels visit: none with nothing visible
        assert visible(i0, j0, b).any(), ("a visited tile is wholly masked", i0, j0)
        return i0, j0, b

    def heads(base, b, h, n):  # a tile loader and writer for head h of an n-head operand
        at, ld = _head(b, h, n, T, hd, tok)

        def load(r0):
            return _attn_tile(mem, base + 4 * at, r0, T, hd, BT, HD, ld)

        def write(r0, vals):
            arr, off = resolve(mem, base + 4 * at)
            for r in range(max(0, min(BT, T - r0))):
                arr[off + (r0 + r) * ld:off + (r0 + r) * ld + hd] = vals[r, :hd]
        return load, write

    def stats(addr, b, h, i0):  # rows [i0, i0 + BT) of L or D [B, H, T], 0 past T
        arr, off = resolve(mem, addr)
        rows = np.minimum(i0 + ar, T - 1) + (b * H + h) * T
        return np.where(i0 + ar < T, arr[off + rows], 0.0)

    if name.startswith("tg_attn_fwd_"):
        out, lse, q, k, v = ptrs
        assert (gx, gy) == (nt, H)
        for b in range(gz):
            for h in range(H):
                Qt, _ = heads(q, b, h, H)
                Kt, _ = heads(k, b, h // G, KV)
                Vt, _ = heads(v, b, h // G, KV)
                _, write = heads(out, b, h, H)
                for qt in range(nt):
                    i0 = qt * BT
                    Q, acc = Qt(i0), np.zeros((BT, HD))
                    # The online softmax, from the sink when there is one (m = sinks[h], l = 1).
                    m, l = (np.full(BT, -np.inf), np.zeros(BT)) if sinks is None else (
                        np.full(BT, sinks[h]), np.ones(BT))
                    for kt in key_tiles(qt, b):
                        s = np.where(visible(*tile_pair(i0, kt * BT, b)),
                                     (Q @ Kt(kt * BT).T) * scale, -np.inf)
                        mn = np.maximum(m, s.max(1))
                        base = np.where(mn == -np.inf, 0.0, mn)
                        p = np.exp(s - base[:, None])
                        alpha = np.exp(m - base)
                        l, m = l * alpha + p.sum(1), mn
                        acc = acc * alpha[:, None] + p @ Vt(kt * BT)
                    with np.errstate(divide="ignore", invalid="ignore"):  # rows past T: l = 0
                        o_rows, l_rows = acc / l[:, None], m + np.log(l)
                    write(i0, o_rows)
                    if lse:
                        n = max(0, min(BT, T - i0))
                        L, Lo = resolve(mem, lse + 4 * ((b * H + h) * T + i0))
                        L[Lo:Lo + n] = l_rows[:n]
        return
    if name.startswith("tg_attn_bwd_dkdv_"):
        dk, dv, q, k, v, g, lse, delta = ptrs
        assert (gx, gy) == (nt, KV)
        for b in range(gz):
            for kvh in range(KV):
                Kt, _ = heads(k, b, kvh, KV)
                Vt, _ = heads(v, b, kvh, KV)
                _, write_dv = heads(dv, b, kvh, KV)
                _, write_dk = heads(dk, b, kvh, KV)
                for kt in range(nt):
                    j0 = kt * BT
                    Ks, Vs = Kt(j0), Vt(j0)
                    dka, dva = np.zeros((BT, HD)), np.zeros((BT, HD))
                    for h in range(kvh * G, kvh * G + G):
                        Qt, _ = heads(q, b, h, H)
                        Gt, _ = heads(g, b, h, H)
                        for qt in query_tiles(kt, b):
                            i0 = qt * BT
                            Q, dO = Qt(i0), Gt(i0)
                            Li, Di = stats(lse, b, h, i0), stats(delta, b, h, i0)
                            vis = visible(*tile_pair(i0, j0, b))   # [query, key]
                            p = np.where(vis, np.exp((Q @ Ks.T) * scale - Li[:, None]), 0.0)
                            ds = p * ((dO @ Vs.T) - Di[:, None]) * scale
                            dva += p.T @ dO
                            dka += ds.T @ Q
                    write_dk(j0, dka)
                    write_dv(j0, dva)
        return
    if name.startswith("tg_attn_bwd_dq_"):
        dq, q, k, v, g, lse, delta = ptrs
        assert (gx, gy) == (nt, H)
        for b in range(gz):
            for h in range(H):
                Qt, _ = heads(q, b, h, H)
                Gt, _ = heads(g, b, h, H)
                Kt, _ = heads(k, b, h // G, KV)
                Vt, _ = heads(v, b, h // G, KV)
                _, write = heads(dq, b, h, H)
                for qt in range(nt):
                    i0 = qt * BT
                    Q, dO = Qt(i0), Gt(i0)
                    Li, Di = stats(lse, b, h, i0), stats(delta, b, h, i0)
                    acc = np.zeros((BT, HD))
                    for kt in key_tiles(qt, b):
                        j0 = kt * BT
                        Ks = Kt(j0)
                        p = np.where(visible(*tile_pair(i0, j0, b)),
                                     np.exp((Q @ Ks.T) * scale - Li[:, None]), 0.0)
                        acc += (p * ((dO @ Vt(j0).T) - Di[:, None]) * scale) @ Ks
                    write(i0, acc)
        return
    raise AssertionError(f"no emulation for {name}")


def _emulate_sinks_gradient(launch, mem):
    """tg_attn_bwd_sinks: d sinks[h] = -sum over (b, i) of exp(sinks[h] - L) * D."""
    dsinks, sinks, lse, delta, B, H, T = [int(x[0]) for x in launch.args]
    assert launch.grid[0] == H
    S, so = resolve(mem, sinks)
    L, Lo = resolve(mem, lse)
    D, Do = resolve(mem, delta)
    out, oo = resolve(mem, dsinks)
    Lv = L[Lo:Lo + B * H * T].reshape(B, H, T)
    Dv = D[Do:Do + B * H * T].reshape(B, H, T)
    out[oo:oo + H] = -(np.exp(S[so:so + H][None, :, None] - Lv) * Dv).sum(axis=(0, 2))


ATTN_LOWERING_CASES = [  # (B, H, KV, T, hd, causal): T off the tile, GQA, every HD bound
    (2, 4, 2, 37, 8, True), (2, 4, 2, 37, 8, False), (1, 6, 2, 70, 64, True),
    (1, 2, 1, 35, 100, True), (2, 3, 3, 16, 128, False), (1, 9, 3, 64, 64, True),
]


@pytest.mark.parametrize("B,H,KV,T,hd,causal", ATTN_LOWERING_CASES)
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_launches_replayed_in_numpy_match_the_cpu_kernels(B, H, KV, T, hd, causal,
                                                                    layout):
    """Grid, block, tile loop bounds (causal skipping), grouped-query head mapping, the
    strides of either layout, L packed after o, the scratch layout of D and the packed
    [dq, dk, dv] addresses."""
    replay_attention_launches(B, H, KV, T, hd, causal, layout=layout)


def replay_attention_launches(B, H, KV, T, hd, causal, window=0, segments=None, sinks=False,
                              layout="bhtd"):
    """Lower attention and its backward, replay every launch with _emulate_attention and
    compare with the numpy kernels (the windowed test below runs it with sliding windows,
    the segment tests at the end with segment ids, the sinks test with sinks; each
    also token-major)."""
    rng = np.random.default_rng(0)
    g = Graph()
    shapes = [(B, T, n, hd) if layout == "bthd" else (B, n, T, hd) for n in (H, KV, KV)]
    vals = [rng.normal(size=s) for s in shapes]
    q, k, v = (g.const(n, x) for n, x in zip("qkv", vals))
    seg = None if segments is None else g.input("segs", (B, T), "i32")
    sink_vals = rng.normal(size=H) * 2 if sinks else None
    sink = g.const("sinks", sink_vals) if sinks else None
    # The kernels take the scale as an f32 argument: give both sides that value.
    att = ops.attention(q, k, v, scale=float(np.float32(hd ** -0.5)), causal=causal,
                        window=window, segments=seg, sinks=sink, layout=layout).srcs[0]
    gout = g.const("gout", rng.normal(size=q.shape))
    back = attention_ops.backward_node(att, gout)
    leaves = (q, k, v, gout) + (() if seg is None else (seg,)) + ((sink,) if sinks else ())
    addr = {t.id: (i + 1) << 24 for i, t in enumerate(leaves + (att, back))}
    mem = {addr[t.id]: np.asarray(x, np.float64).ravel().copy()
           for t, x in zip(leaves, (*vals, gout.data, *([] if seg is None else [segments]),
                                    *([sink_vals] if sinks else [])))}
    vals = vals + ([] if seg is None else [segments]) + ([sink_vals] if sinks else [])
    for t in (att, back):
        mem[addr[t.id]] = np.full(t.size, np.nan)  # every element must be written
    scratch = 200 << 24
    assert dispatch.scratch_bytes(att) == 0
    mem[scratch] = np.full(dispatch.scratch_bytes(back) // 4, np.nan)
    for node in (att, back):
        launches = dispatch.lower(node, lambda t: addr[t.id], scratch)
        assert [l.kernel.rsplit("_", 1)[0] for l in launches] == (
            ["tg_attn_fwd"] if node is att else
            ["tg_attn_bwd_prep", "tg_attn_bwd_dkdv", "tg_attn_bwd_dq"] + ["tg_attn_bwd"] * sinks)
        for launch in launches:
            assert all(isinstance(x, np.ndarray) and x.dtype in (np.int32, np.uint64, np.float32)
                       for x in launch.args)
            assert launch.kernel in KERNEL_NAMES
            assert launch.kernel in OP_KERNELS[node.op]
            _emulate_attention(launch, mem)
    for node, srcs in ((att, vals), (back, (*vals, mem[addr[att.id]], gout.data))):
        want = np.zeros(node.shape)
        CPU_KERNELS[node.op](want, [np.asarray(x, np.float64) for x in srcs], node.attrs)
        got = mem[addr[node.id]]
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got.reshape(node.shape), want, rtol=1e-10, atol=1e-10)


def test_attention_head_dim_selection_and_limit():
    assert [attention_cuda.attention_config(hd)[0] for hd in (1, 32, 33, 64, 65, 128)] == \
        [32, 32, 64, 64, 128, 128]
    g = Graph()
    q = g.const("q", np.zeros((1, 2, 4, 160)))
    with pytest.raises(CudaError, match="head_dim 160"):
        dispatch.lower(ops.attention(q, q, q, scale=1.0).srcs[0], lambda t: 1 << 20)


def test_attention_instantiations_match_the_lowering_tiles():
    """flash_attention.cu's wrapper for head_dim bound HD passes (HD, TG_ATTN_BT_<HD>,
    TG_ATTN_TPR_<HD>), with __launch_bounds__(TG_ATTN_THREADS_<HD>), and those macros are
    the (BT, TPR, BT * TPR) that constants.ATTN_TILES launches with."""
    from toygraph.ops.lowering.constants import DEFINES
    src = read_source("flash_attention.cu")
    instantiated = {int(hd) for hd in re.findall(r"\btg_attn_fwd_(\d+)\(", src)}
    assert instantiated == set(ATTN_HEAD_DIMS) == set(constants.ATTN_TILES)
    for part in ("fwd", "bwd_prep", "bwd_dkdv", "bwd_dq"):
        for HD, (BT, TPR) in constants.ATTN_TILES.items():
            m = re.search(rf"__launch_bounds__\((\w+)\)\s+tg_attn_{part}_{HD}\(.*?\)\s*{{\s*"
                          rf"attn_{part}<(\w+), (\w+), (\w+)>", src, re.S)
            assert m, (part, HD)
            assert m.groups() == (f"TG_ATTN_THREADS_{HD}", str(HD), f"TG_ATTN_BT_{HD}",
                                  f"TG_ATTN_TPR_{HD}")
            assert [DEFINES[x] for x in (m[1], m[3], m[4])] == [BT * TPR, BT, TPR]


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_kernels_compile_without_spills(arch):
    """Register arrays indexed by unrolled constants only (no stack, no spills) and static
    shared memory within the 48 KB a block gets without an opt-in (none in the prep
    kernels, which only sum rows)."""
    from support.ptxas import bf16_module
    names = {n for op in ("attention", "attention_back") for n in OP_KERNELS[op]}
    usage = {n: u for n, u in bf16_module(arch)[1].items() if n.startswith("tg_attn_")}
    assert set(usage) == names
    for name, u in usage.items():
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
        assert 0 < u["registers"] <= 255, (name, u)
        if name.startswith("tg_attn_bwd_prep_"):   # D = rowsum(dO * O): no tiles
            assert u["smem"] == 0, (name, u)
        else:
            assert 0 < u["smem"] <= 48 * 1024, (name, u)


# --- sliding-window attention -------------------------------------------------------------------
@pytest.mark.parametrize("B,H,KV,T,hd,window", [
    (2, 4, 2, 37, 8, 5),        # window inside one 32-row tile, T off the tile
    (1, 6, 2, 100, 64, 40),     # window across a tile edge: whole key tiles skipped
    (1, 4, 1, 70, 64, 32),      # window exactly one tile
    (1, 2, 1, 35, 100, 17),     # the HD=128 kernels (16-row tiles): several tiles skipped
    (2, 3, 3, 50, 128, 1),      # window 1: each query sees only itself
    (1, 9, 3, 64, 64, 64),      # window == T: plain causal
    (1, 4, 2, 37, 8, 1000),     # window past T
])
def test_windowed_attention_launches_replayed_in_numpy_match_the_cpu_kernels(B, H, KV, T, hd,
                                                                             window):
    replay_attention_launches(B, H, KV, T, hd, True, window)
    if window in (5, 40):
        replay_attention_launches(B, H, KV, T, hd, True, window, layout="bthd")


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_launches_carry_the_window_and_layout_as_int32s(layout):
    g = Graph()
    q = g.const("q", np.zeros((1, 2, 40, 8)))
    node = ops.attention(q, q, q, scale=0.5, window=7, layout=layout).srcs[0]
    (launch,) = dispatch.lower(node, lambda t: 1 << 20)
    assert all(x.dtype == np.int32 for x in launch.args[-3:])
    assert [int(x[0]) for x in launch.args[-3:]] == [1, 7, layout == "bthd"]  # causal, window


# --- attention sinks (gpt-oss) -------------------------------------------------------------------
@pytest.mark.parametrize("B,H,KV,T,hd,window", [
    (2, 4, 2, 37, 8, 0),        # T off the tile, grouped-query
    (1, 6, 2, 70, 64, 40),      # a sliding window across a tile edge
    (1, 2, 1, 35, 100, 0),      # the HD=128 kernels
])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_with_sinks_launches_replayed_in_numpy_match_the_cpu_kernels(B, H, KV, T, hd,
                                                                               window, layout):
    """The sinks seed the forward's online softmax, so the L it saves, and
    tg_attn_bwd_sinks turns L and D into their gradient (packed after dv)."""
    replay_attention_launches(B, H, KV, T, hd, True, window, sinks=True, layout=layout)


# --- segment ids (sample packing) on the host executor -----------------------------------
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
    """The emulator above follows the kernels' tile loops, skipping the tiles
    attn_tile_live rejects, and fails on any visited tile with nothing visible in it."""
    segs = ragged_segments(np.random.default_rng(4), B, T)
    replay_attention_launches(B, H, KV, T, hd, causal, window, segments=segs)
