"""rope (ops/rotary/): f64 finite-difference gradients and values in both layouts, the
frequency factors and linear scaling against transformers' llama3 rope, their errors, and
the CUDA launch's per-element index math replayed in numpy against the numpy kernel."""
import math

import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, forward_f64, rnd, weighted_sum
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.ops.lowering import dispatch
from support.kernelsrc import OP_KERNELS
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from toygraph.ops import KERNELS as CPU_KERNELS


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


# --- rope with frequency factors and linear scaling -------------------------------------------
def test_rope_defaults_are_the_plain_rope_bit_for_bit():
    rng = np.random.default_rng(23)
    g = Graph()
    x = g.const("x", rnd(rng, 2, 3, 2, 8))
    pos = g.input("pos", (2, 3), "i32")
    ones = g.const("ones", np.ones(4))
    plain = g.output(ops.rope(x, pos, dims=8, base=1e4))
    unit = g.output(ops.rope(x, pos, dims=8, base=1e4, freq_factors=ones, freq_scale=1.0))
    s = forward_f64(g, {pos: np.array([[0, 1, 2], [5, 9, 3]], np.int32)})
    np.testing.assert_array_equal(s.download(plain), s.download(unit))


def llama3_rope_factors(head_dim, base, scaling):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for rope_type
    "llama3" (LlamaModel.generate_extra_tensors): 1 for short wavelengths, ``factor`` for
    long ones, 1 / ((1 - smooth) / factor + smooth) in between, stored f32."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_rope_factors_reproduce_transformers_llama3_rope():
    """With the converter's factors, toygraph's rope equals Hugging Face's rotary embedding
    built from ROPE_INIT_FUNCTIONS["llama3"] (the neox layout HF checkpoints use)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    hd, base = 64, 500000.0
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=2 * hd, num_attention_heads=2, head_dim=hd, rope_theta=base,
                      rope_scaling=scaling, max_position_embeddings=131072)
    hf_inv_freq = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0].double().numpy()
    factors = llama3_rope_factors(hd, base, scaling)
    # All three regimes occur: untouched, divided by the factor, and smoothed.
    assert factors.min() == 1 and factors.max() == 32 and ((factors > 1) & (factors < 32)).any()
    ours_inv_freq = base ** (-np.arange(0, hd, 2) / hd) / factors.astype(np.float64)
    np.testing.assert_allclose(ours_inv_freq, hf_inv_freq, rtol=1e-6)  # HF works in f32

    rng = np.random.default_rng(24)
    xv, posv = rng.normal(size=(1, 6, 2, hd)), np.array([[0, 1, 7, 100, 1000, 2047]], np.int32)
    g = Graph()
    pos = g.input("pos", posv.shape, "i32")
    x, ff = g.const("x", xv), g.const("rope_freqs", factors)
    y = g.output(ops.rope(x, pos, dims=hd, base=base, mode="neox", freq_factors=ff))
    plain = g.output(ops.rope(x, pos, dims=hd, base=base, mode="neox"))
    s = forward_f64(g, {pos: posv})
    angles = posv[0][:, None] * hf_inv_freq
    emb = torch.tensor(np.concatenate([angles, angles], axis=-1))[None]
    xt = torch.tensor(xv).transpose(1, 2)  # HF: [batch, heads, seq, head_dim]
    want = apply_rotary_pos_emb(xt, xt, emb.cos(), emb.sin())[0].transpose(1, 2).numpy()
    # HF's inverse frequencies are f32 (relative rounding <= 6e-8): at position 2047 the
    # angles may differ by ~1.2e-4 rad, so that is the agreement to expect, not 1e-12.
    assert np.abs(s.download(y) - want).max() <= 3e-4
    assert np.abs(s.download(plain) - want).max() > 0.1  # without the factors: far off


def test_rope_factor_and_scale_errors():
    g = Graph()
    x, pos = g.input("x", (1, 2, 2, 8)), g.input("pos", (1, 2), "i32")
    with pytest.raises(GraphError, match=r"rope.*freq_factors must be f32 \[4\]"):
        ops.rope(x, pos, dims=8, base=1e4, freq_factors=g.const("f5", np.ones(5)))
    with pytest.raises(GraphError, match=r"rope.*freq_factors must be f32"):
        ops.rope(x, pos, dims=8, base=1e4, freq_factors=g.input("fi", (4,), "i32"))
    with pytest.raises(GraphError, match="rope.*freq_scale must be positive"):
        ops.rope(x, pos, dims=8, base=1e4, freq_scale=0.0)


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
    (launch,) = dispatch.lower(node, lambda t: addr[t.id])
    assert launch.kernel == "tg_rope" and launch.kernel in OP_KERNELS["rope"]
    assert [v.dtype for v in launch.args] == [np.uint64] * 4 + [np.int32] * 4 + \
        [np.float64] * 2 + [np.int32] * 3
    assert int(launch.args[-1][0]) == 0     # the bf16 mask: f32 x and out
    _emulate_rope(launch, mem)
    want = np.zeros(node.shape)
    CPU_KERNELS["rope"](want, [np.asarray(v, np.float64) for v in srcs], node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_between_products_reads_and_writes_bf16(mode, monkeypatch):
    """At bf16 a rope whose input a product makes and whose output only products read
    keeps both in bf16 (cuda/bf16_storage.py) and rotates the rounded input in f32: the host
    executor's forward and gradients within bf16's rounding of the f32-storage run."""
    from support.cudaemu import training_plan
    from support.hostparity import MIXED_TOL, rel_err, run_phase
    from toygraph.core.autodiff import accumulate_grads, backward
    from toygraph.cuda.bf16_storage import plan_bf16
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")

    def build():
        rng = np.random.default_rng(3)
        g = Graph()
        x, w1 = g.param("x", rnd(rng, 2, 5, 16)), g.param("w1", rnd(rng, 16, 24))
        w2 = g.param("w2", rnd(rng, 24, 8))
        pos = g.input("pos", (2, 5), "i32")
        q = ops.reshape(ops.matmul(x, w1), (2, 5, 3, 8))
        r = ops.rope(q, pos, dims=8, base=500.0, mode=mode)
        z = g.output(ops.matmul(ops.reshape(r, (2, 5, 24)), w2))
        loss = ops.sum(ops.mul(z, g.const("c", rnd(rng, 2, 5, 8))))
        grads = accumulate_grads(backward(loss, [x, w1, w2]))
        return g, pos, r, [z] + [grads[p] for p in (g.find("x"), w1, w2)]

    posv = np.array([[0, 1, 2, 3, 4], [7, 3, 9, 1, 0]], np.int32)
    g, pos, r, fetch = build()
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    assert r.id in half and r.srcs[0].id in half
    got = run_phase(g, "cuda", {pos: posv}, "backward", fetch, "bf16")
    monkeypatch.setenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "0")
    g2, pos2, _, fetch2 = build()
    want = run_phase(g2, "cuda", {pos2: posv}, "backward", fetch2, "bf16")
    for a, b in zip(got, want):
        assert rel_err(a, b) <= MIXED_TOL["bf16"], rel_err(a, b)
