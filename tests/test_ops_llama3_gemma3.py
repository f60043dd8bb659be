"""The ops Llama 3.x and Gemma 3 add (GELU-tanh, rope frequency factors and linear scaling,
sliding-window attention, per-head q/k norms) against independent references: torch's
GELU, transformers' llama3 rope, an explicitly masked softmax; plus f64 finite-difference
gradients (max relative error <= 1e-6) for GELU and the q/k norm. The rope and windowed
attention gradient checks are parametrisations of test_ops.py's."""
import math

import numpy as np
import pytest

from gradcheck import check_gradients, weighted_sum
from test_ops import (TOL, WINDOW_CASES, _attn_inputs,  # noqa: F401 (attn_rows: fixture)
                      assert_attention_matches, attn_rows, rnd)
from toygraph import ops
from toygraph.errors import GraphError
from toygraph.graph import Graph
from toygraph.session import Session


def _forward(g, inputs=None):
    s = Session(g, dtype="f64")
    s.realize()
    for t, v in (inputs or {}).items():
        s.upload(t, v)
    s.run("forward")
    return s


# --- GELU (tanh approximation) --------------------------------------------------------------
def test_gelu_gradient():
    rng = np.random.default_rng(20)
    g = Graph()
    x = g.param("x", rnd(rng, 3, 7, s=2.0))
    assert check_gradients(g, weighted_sum(x.gelu(), rng), [x], {}) <= TOL


def test_geglu_gradient():
    rng = np.random.default_rng(21)
    g = Graph()
    a, b = g.param("gate", rnd(rng, 4, 6, s=2.0)), g.param("up", rnd(rng, 4, 6))
    assert check_gradients(g, weighted_sum(ops.geglu(a, b), rng), [a, b], {}) <= TOL


def test_gelu_matches_torch_tanh_approximation():
    torch = pytest.importorskip("torch")
    xv = np.concatenate([np.linspace(-12, 12, 241), [-100.0, 100.0, 0.0]])
    g = Graph()
    y = g.output(ops.gelu(g.const("x", xv)))
    want = torch.nn.functional.gelu(torch.tensor(xv), approximate="tanh").numpy()
    np.testing.assert_allclose(_forward(g).download(y), want, rtol=1e-12, atol=1e-15)


# --- rope with frequency factors and linear scaling -------------------------------------------
def test_rope_defaults_are_the_plain_rope_bit_for_bit():
    rng = np.random.default_rng(23)
    g = Graph()
    x = g.const("x", rnd(rng, 2, 3, 2, 8))
    pos = g.input("pos", (2, 3), "i32")
    ones = g.const("ones", np.ones(4))
    plain = g.output(ops.rope(x, pos, dims=8, base=1e4))
    unit = g.output(ops.rope(x, pos, dims=8, base=1e4, freq_factors=ones, freq_scale=1.0))
    s = _forward(g, {pos: np.array([[0, 1, 2], [5, 9, 3]], np.int32)})
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
    s = _forward(g, {pos: posv})
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
    s = _forward(g)
    np.testing.assert_array_equal(s.download(outs[0]), s.download(outs[1]))
    np.testing.assert_array_equal(s.download(outs[0]), s.download(outs[2]))


def test_window_errors():
    g = Graph()
    q = g.input("q", (1, 2, 5, 4))
    with pytest.raises(GraphError, match="attention.*sliding window needs causal=True"):
        ops.attention(q, q, q, scale=1.0, causal=False, window=3)
    with pytest.raises(GraphError, match="attention.*window must be >= 0"):
        ops.attention(q, q, q, scale=1.0, window=-1)


# --- per-head q/k norm (Qwen3, Gemma 3): rms_norm of [B, T, H, hd] times a [hd] weight -------
def test_per_head_rms_norm_times_weight_gradient():
    rng = np.random.default_rng(28)
    g = Graph()
    x, w = g.param("x", rnd(rng, 2, 3, 4, 5)), g.param("w", rnd(rng, 5))
    y = ops.mul(ops.rms_norm(x, 1e-6), w)
    assert check_gradients(g, weighted_sum(y, rng), [x, w], {}) <= TOL
