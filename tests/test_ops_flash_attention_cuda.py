"""The fused attention op's CUDA side (ops/flash_attention.py, flash_attention.cu): the
tiled algorithm of every launch replayed in numpy (following the kernels' tile loop
bounds, failing on any visited tile with nothing visible in it) against the numpy
kernels, with grouped-query heads, every head_dim bound and sliding windows; the head-dim
selection, the instantiated tiles, and the compiled kernels' register use."""
import re

import numpy as np
import pytest

from cudaemu import needs_nvrtc, resolve
from toygraph.core import ops
from toygraph.cuda.lowering import constants, dispatch
from kernelsrc import KERNEL_NAMES
from kernelsrc import OP_KERNELS
from toygraph.cuda.lowering.constants import ATTN_HEAD_DIMS
from toygraph.cuda.lowering.sources import module_source, read_source
from toygraph.errors import CudaError
from toygraph.core.graph import Graph
from toygraph.core.ops import KERNELS as CPU_KERNELS
from toygraph.core.ops import flash_attention as attention_ops


def _attn_tile(mem, addr, r0, T, hd, BT, HD):
    """Rows [r0, r0 + BT) of the [T, hd] matrix at ``addr``, zero-filled to [BT, HD]."""
    arr, off = resolve(mem, addr)
    out = np.zeros((BT, HD))
    n = max(0, min(BT, T - r0))
    out[:n, :hd] = arr[off + r0 * hd:off + (r0 + n) * hd].reshape(n, hd)
    return out


# One function of ~140 lines on purpose: it follows flash_attention.cu's four kernels
# branch by branch, loop by loop, so the two read side by side.
def _emulate_attention(launch, mem):
    """Replay one attention launch block by block with the kernel's own loop bounds, tiles,
    online softmax, scratch layout and output addresses (numpy, f64)."""
    name = launch.kernel
    if name == "tg_attn_bwd_sinks":
        _emulate_sinks_gradient(launch, mem)
        return
    HD = int(name.rsplit("_", 1)[1])
    BT, TPR = constants.ATTN_TILES[HD]
    assert launch.block == (BT * TPR, 1, 1)
    a = [x[0] for x in launch.args]
    H, KV, T, hd, scale, causal, window = (int(a[-7]), int(a[-6]), int(a[-5]), int(a[-4]),
                                           float(a[-3]), int(a[-2]), int(a[-1]))
    # Pointers end with the segment ids (or 0), then, in fwd and prep, the sinks (or 0).
    *ptrs, seg_addr = [int(x) for x in a[:-7]]
    sinks = None
    if name.startswith(("tg_attn_fwd_", "tg_attn_bwd_prep_")):
        *ptrs, seg_addr, sink_addr = ptrs + [seg_addr]
        if sink_addr:
            arr, off = resolve(mem, sink_addr)
            sinks = arr[off:off + H]
    G, nt, head = H // KV, (T + BT - 1) // BT, T * hd
    gx, gy, gz = launch.grid
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

    def write(addr, rows0, vals):  # rows [rows0, rows0 + BT) of a [T, hd] matrix
        arr, off = resolve(mem, addr)
        n = max(0, min(BT, T - rows0))
        arr[off + rows0 * hd:off + (rows0 + n) * hd] = vals[:n, :hd].ravel()

    def scores(Q, i0, kaddr, qt, b, h):
        """Online row max / sum over query tile qt's key tiles, from the sink when there is
        one (m = sinks[h], l = 1); yields per tile (j0, s, base)."""
        m, l = np.full(BT, -np.inf), np.zeros(BT)
        if sinks is not None:
            m, l = np.full(BT, sinks[h]), np.ones(BT)
        for kt in key_tiles(qt, b):
            Ks = _attn_tile(mem, kaddr, kt * BT, T, hd, BT, HD)
            s = np.where(visible(*tile_pair(i0, kt * BT, b)), (Q @ Ks.T) * scale, -np.inf)
            mn = np.maximum(m, s.max(1))
            base = np.where(mn == -np.inf, 0.0, mn)
            p = np.exp(s - base[:, None])
            alpha = np.exp(m - base)
            l = l * alpha + p.sum(1)
            m = mn
            yield kt * BT, p, alpha, m, l

    if name.startswith("tg_attn_fwd_") or name.startswith("tg_attn_bwd_prep_"):
        assert (gx, gy, gz) == (nt, H, launch.grid[2])
        for b in range(gz):
            for h in range(H):
                kv = b * KV + h // G
                for qt in range(nt):
                    i0 = qt * BT
                    if name.startswith("tg_attn_fwd_"):
                        out, q, k, v = ptrs
                        Q = _attn_tile(mem, q + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        acc = np.zeros((BT, HD))
                        for j0, p, alpha, m, l in scores(Q, i0, k + 4 * kv * head, qt, b, h):
                            Vs = _attn_tile(mem, v + 4 * kv * head, j0, T, hd, BT, HD)
                            acc = acc * alpha[:, None] + p @ Vs
                        write(out + 4 * (b * H + h) * head, i0, acc / l[:, None])
                    else:
                        lse, delta, q, k, o, g = ptrs
                        Q = _attn_tile(mem, q + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        m, l = (np.full(BT, -np.inf), np.zeros(BT)) if sinks is None else (
                            np.full(BT, sinks[h]), np.ones(BT))
                        for _, _, _, m, l in scores(Q, i0, k + 4 * kv * head, qt, b, h):
                            pass
                        O = _attn_tile(mem, o + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        dO = _attn_tile(mem, g + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        n = max(0, min(BT, T - i0))
                        L, Lo = resolve(mem, lse + 4 * ((b * H + h) * T + i0))
                        D, Do = resolve(mem, delta + 4 * ((b * H + h) * T + i0))
                        L[Lo:Lo + n] = (m + np.log(l))[:n]
                        D[Do:Do + n] = (O * dO).sum(1)[:n]
        return
    if name.startswith("tg_attn_bwd_dkdv_"):
        dk, dv, q, k, v, g, lse, delta = ptrs
        assert (gx, gy) == (nt, KV)
        for b in range(gz):
            for kvh in range(KV):
                kv = b * KV + kvh
                for kt in range(nt):
                    j0 = kt * BT
                    Ks = _attn_tile(mem, k + 4 * kv * head, j0, T, hd, BT, HD)
                    Vs = _attn_tile(mem, v + 4 * kv * head, j0, T, hd, BT, HD)
                    dka, dva = np.zeros((BT, HD)), np.zeros((BT, HD))
                    for h in range(kvh * G, kvh * G + G):
                        qa, ga = q + 4 * (b * H + h) * head, g + 4 * (b * H + h) * head
                        for qt in query_tiles(kt, b):
                            i0 = qt * BT
                            Q = _attn_tile(mem, qa, i0, T, hd, BT, HD)
                            dO = _attn_tile(mem, ga, i0, T, hd, BT, HD)
                            rows = np.minimum(i0 + ar, T - 1) + (b * H + h) * T
                            L, Lo = resolve(mem, lse)
                            D, Do = resolve(mem, delta)
                            Li = np.where(i0 + ar < T, L[Lo + rows], 0.0)
                            Di = np.where(i0 + ar < T, D[Do + rows], 0.0)
                            vis = visible(*tile_pair(i0, j0, b))   # [query, key]
                            p = np.where(vis, np.exp((Q @ Ks.T) * scale - Li[:, None]), 0.0)
                            ds = p * ((dO @ Vs.T) - Di[:, None]) * scale
                            dva += p.T @ dO
                            dka += ds.T @ Q
                    write(dk + 4 * kv * head, j0, dka)
                    write(dv + 4 * kv * head, j0, dva)
        return
    if name.startswith("tg_attn_bwd_dq_"):
        dq, q, k, v, g, lse, delta = ptrs
        assert (gx, gy) == (nt, H)
        for b in range(gz):
            for h in range(H):
                kv = b * KV + h // G
                for qt in range(nt):
                    i0 = qt * BT
                    Q = _attn_tile(mem, q + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                    dO = _attn_tile(mem, g + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                    rows = np.minimum(i0 + ar, T - 1) + (b * H + h) * T
                    L, Lo = resolve(mem, lse)
                    D, Do = resolve(mem, delta)
                    Li = np.where(i0 + ar < T, L[Lo + rows], 0.0)
                    Di = np.where(i0 + ar < T, D[Do + rows], 0.0)
                    acc = np.zeros((BT, HD))
                    for kt in key_tiles(qt, b):
                        j0 = kt * BT
                        Ks = _attn_tile(mem, k + 4 * kv * head, j0, T, hd, BT, HD)
                        Vs = _attn_tile(mem, v + 4 * kv * head, j0, T, hd, BT, HD)
                        p = np.where(visible(*tile_pair(i0, j0, b)),
                                     np.exp((Q @ Ks.T) * scale - Li[:, None]), 0.0)
                        acc += (p * ((dO @ Vs.T) - Di[:, None]) * scale) @ Ks
                    write(dq + 4 * (b * H + h) * head, i0, acc)
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
def test_attention_launches_replayed_in_numpy_match_the_cpu_kernels(B, H, KV, T, hd, causal):
    """Grid, block, tile loop bounds (causal skipping), grouped-query head mapping, the
    scratch layout of the row statistics and the packed [dq, dk, dv] addresses."""
    replay_attention_launches(B, H, KV, T, hd, causal)


def replay_attention_launches(B, H, KV, T, hd, causal, window=0, segments=None, sinks=False):
    """Lower attention and its backward, replay every launch with _emulate_attention and
    compare with the numpy kernels (the windowed test below runs it with sliding windows,
    test_ops_flash_attention_segments.py with segment ids, the sinks test with sinks)."""
    rng = np.random.default_rng(0)
    g = Graph()
    vals = [rng.normal(size=s) for s in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))]
    q, k, v = (g.const(n, x) for n, x in zip("qkv", vals))
    seg = None if segments is None else g.input("segs", (B, T), "i32")
    sink_vals = rng.normal(size=H) * 2 if sinks else None
    sink = g.const("sinks", sink_vals) if sinks else None
    # The kernels take the scale as an f32 argument: give both sides that value.
    att = ops.attention(q, k, v, scale=float(np.float32(hd ** -0.5)), causal=causal,
                        window=window, segments=seg, sinks=sink)
    gout = g.const("gout", rng.normal(size=att.shape))
    need = [True] * 3 + [False] * (seg is not None) + [True] * sinks
    back = ops.OPS["attention"].grad(att, gout, need)[0]
    back = back.srcs[0]
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
    for node, srcs in ((att, vals), (back, (*vals, mem[addr[att.id]].reshape(att.shape),
                                            gout.data))):
        want = np.zeros(node.shape)
        CPU_KERNELS[node.op](want, [np.asarray(x, np.float64) for x in srcs], node.attrs)
        got = mem[addr[node.id]]
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got.reshape(node.shape), want, rtol=1e-10, atol=1e-10)


def test_attention_head_dim_selection_and_limit():
    assert [attention_ops.attention_config(hd)[0] for hd in (1, 32, 33, 64, 65, 128)] == \
        [32, 32, 64, 64, 128, 128]
    g = Graph()
    q = g.const("q", np.zeros((1, 2, 4, 160)))
    with pytest.raises(CudaError, match="head_dim 160"):
        dispatch.lower(ops.attention(q, q, q, scale=1.0), lambda t: 1 << 20)


def test_attention_instantiations_match_the_lowering_tiles():
    """attention.cu's wrapper for head_dim bound HD passes (HD, TG_ATTN_BT_<HD>,
    TG_ATTN_TPR_<HD>), with __launch_bounds__(TG_ATTN_THREADS_<HD>), and those macros are
    the (BT, TPR, BT * TPR) that constants.ATTN_TILES launches with."""
    from toygraph.cuda.lowering.constants import DEFINES
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
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_attention_kernels_compile_without_spills(arch, cache):
    """Register arrays indexed by unrolled constants only (no stack, no spills) and static
    shared memory within the 48 KB a block gets without an opt-in."""
    from toygraph.cuda.nvrtc import resource_usage
    names = {n for op in ("attention", "attention_back") for n in OP_KERNELS[op]}
    usage = resource_usage(module_source(("flash_attention.cu",)), arch,
                           name="flash_attention.cu")
    assert set(usage) == names
    for name, u in usage.items():
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
        assert 0 < u["registers"] <= 255, (name, u)
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


def test_attention_launches_carry_the_window_as_an_int32():
    g = Graph()
    q = g.const("q", np.zeros((1, 2, 40, 8)))
    node = ops.attention(q, q, q, scale=0.5, window=7)
    (launch,) = dispatch.lower(node, lambda t: 1 << 20)
    assert launch.args[-1].dtype == np.int32 and int(launch.args[-1][0]) == 7
    assert int(launch.args[-2][0]) == 1  # causal


# --- attention sinks (gpt-oss) -------------------------------------------------------------------
@pytest.mark.parametrize("B,H,KV,T,hd,window", [
    (2, 4, 2, 37, 8, 0),        # T off the tile, grouped-query
    (1, 6, 2, 70, 64, 40),      # a sliding window across a tile edge
    (1, 2, 1, 35, 100, 0),      # the HD=128 kernels
])
def test_attention_with_sinks_launches_replayed_in_numpy_match_the_cpu_kernels(B, H, KV, T, hd,
                                                                               window):
    """The sinks seed the online softmax of the forward and of the row statistics, and
    tg_attn_bwd_sinks turns those statistics into their gradient (packed after dv)."""
    replay_attention_launches(B, H, KV, T, hd, True, window, sinks=True)
