"""CUDA without a GPU, for the ops Llama 3.x and Gemma 3 add: sliding-window attention's
launches replayed in numpy (test_cuda_compile's emulator, which follows the kernels' tile
loop bounds and fails on any visited tile with nothing visible in it), rope's frequency
factors and linear scaling in the launch and its per-element index math, GELU's launches,
and the per-head q/k norm (rms_norm and a broadcast mul over [B, T, H, hd]).
Compilation for sm_80/sm_90 and the no-spill check of the attention kernels are
test_cuda_compile.py's, over the whole module."""
import numpy as np
import pytest

from test_cuda_compile import _check_lowering, _node, replay_attention_launches
from toygraph import ops
from toygraph.cpu.kernels import KERNELS as CPU_KERNELS
from toygraph.cuda import lowering
from toygraph.cuda.kernels import KERNEL_NAMES
from toygraph.cuda.lowering import OP_KERNELS
from toygraph.graph import Graph


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
    (launch,) = lowering.lower(node, lambda t: 1 << 20)
    assert launch.args[-1].dtype == np.int32 and int(launch.args[-1][0]) == 7
    assert int(launch.args[-2][0]) == 1  # causal


# --- rope with frequency factors and linear scaling -----------------------------------------------
def _emulate_rope(launch, mem):
    """tg_rope's per-element index math in numpy (f64): element e of row e // D, its pair
    and partner, the angle freq_scale * pos * base^(-2 pair/dims) / factors[pair] (no
    factors when the pointer is null), features past dims copied."""
    a = [x[0] for x in launch.args]
    out, x, pos, factors = (mem.get(int(v)) for v in a[:4])
    n, heads, D, dims = (int(v) for v in a[4:8])
    base, freq_scale, neox, inverse = float(a[8]), float(a[9]), int(a[10]), int(a[11])
    assert (factors is None) == (int(a[3]) == 0)
    e = np.arange(n)
    row, j = e // D, e % D
    half = dims // 2
    if neox:
        second = j >= half
        pair = np.where(second, j - half, j)
        i0, i1 = pair, pair + half
    else:
        second, pair = j & 1, j >> 1
        i0, i1 = 2 * pair, 2 * pair + 1
    pair = np.minimum(pair, half - 1)  # features past dims: any valid pair, result unused
    inv_freq = base ** (-(2 * pair) / dims)
    if factors is not None:
        inv_freq = inv_freq / factors[pair]
    theta = pos[row // heads] * inv_freq * freq_scale
    c, s = np.cos(theta), np.sin(theta) * (-1 if inverse else 1)
    x0, x1 = x[row * D + np.minimum(i0, D - 1)], x[row * D + np.minimum(i1, D - 1)]
    rotated = np.where(second, x0 * s + x1 * c, x0 * c - x1 * s)
    out[:] = np.where(j >= dims, x[e], rotated)


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("dims", [8, 6])
@pytest.mark.parametrize("factors,freq_scale,inverse", [
    (None, 1.0, False), ([1.0, 2.5, 32.0, 0.5], 0.25, False), ([1.0, 2.5, 32.0, 0.5], 0.5, True),
])
def test_rope_launch_replayed_in_numpy_matches_the_cpu_kernel(mode, dims, factors, freq_scale,
                                                              inverse):
    rng = np.random.default_rng(3)
    g = Graph()
    xv, posv = rng.normal(size=(2, 5, 3, 8)), rng.integers(0, 5000, size=(2, 5))
    x, pos = g.const("x", xv), g.input("pos", (2, 5), "i32")
    srcs = [xv, posv]
    ff = None
    if factors is not None:
        srcs.append(np.array(factors[:dims // 2]))
        ff = g.const("rope_freqs", srcs[-1])
    node = ops.rope(x, pos, dims=dims, base=500000.0, mode=mode, freq_factors=ff,
                    freq_scale=freq_scale, inverse=inverse)
    addr = {t.id: (i + 1) << 20 for i, t in enumerate([*node.srcs, node])}
    mem = {addr[t.id]: np.asarray(v, np.float64).ravel() for t, v in zip(node.srcs, srcs)}
    mem[addr[node.id]] = np.full(node.size, np.nan)
    (launch,) = lowering.lower(node, lambda t: addr[t.id])
    assert launch.kernel == "tg_rope" and launch.kernel in OP_KERNELS["rope"]
    assert [v.dtype for v in launch.args] == [np.uint64] * 4 + [np.int32] * 4 + \
        [np.float64] * 2 + [np.int32] * 2
    _emulate_rope(launch, mem)
    want = np.zeros(node.shape)
    CPU_KERNELS["rope"](want, [np.asarray(v, np.float64) for v in srcs], node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)


# --- GELU and the per-head q/k norm ---------------------------------------------------------------
def test_gelu_launches():
    g = Graph()
    x, dy = g.const("x", np.zeros((3, 70))), g.const("dy", np.zeros((3, 70)))
    for node, kernel, n_ptr in ((ops.gelu(x), "tg_gelu", 2), (ops.gelu_back(x, dy),
                                                               "tg_gelu_back", 3)):
        (launch,) = lowering.lower(node, lambda t: (t.id + 1) << 20)
        assert launch.kernel == kernel and kernel in KERNEL_NAMES
        assert kernel in OP_KERNELS[node.op]
        assert [v.dtype for v in launch.args] == [np.uint64] * n_ptr + [np.int32]
        assert int(launch.args[-1][0]) == 210 and launch.grid[0] * launch.block[0] >= 210


def test_per_head_rms_norm_lowers_to_rows_over_head_dim():
    g = Graph()
    x = g.const("x", np.zeros((2, 3, 4, 40)))
    for node in (ops.rms_norm(x, 1e-6), ops.OPS["rms_norm"].grad(ops.rms_norm(x, 1e-6), x,
                                                                  [True])[0]):
        (launch,) = lowering.lower(node, lambda t: (t.id + 1) << 20)
        rows, D = (int(v[0]) for v in launch.args[-3:-1])
        assert (launch.kernel, rows, D) == ("tg_" + node.op, 24, 40)


@pytest.mark.parametrize("shapes", [[(2, 3, 4, 5), (5,)], [(2, 3, 4, 5), (1, 1, 4, 1)]])
def test_four_d_broadcast_mul_lowering_matches_numpy(shapes):
    _check_lowering(*_node(ops.mul, *shapes))
