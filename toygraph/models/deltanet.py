"""Qwen3.5's Gated DeltaNet layer (the token mixer of its recurrent layers), as graph ops:

    qkv = silu(causal_conv1d(x W_qkv^T))            -> q, k [B, T, nk, dk], v [B, T, nv, dv]
    q, k = l2norm(q) / sqrt(dk), l2norm(k)          (then tiled up to the nv value heads)
    beta = sigmoid(x W_beta^T),  g = ssm_a * softplus(x W_alpha^T + dt_bias)
    o = delta_rule(q, k, v, g, beta)                 (ops/deltanet/)
    out = (rms_norm(o) * w_norm * silu(x W_z^T)) W_out^T

as transformers' Qwen3_5GatedDeltaNet computes it. llama.cpp's converter stores ssm_a =
-exp(A_log), and, when nv > nk, the value heads in "tiled" order (value head m reads key
head m % nk), which every value-side tensor of the file shares, so the math is unchanged.
L2 normalisation is rms_norm with eps / d, divided by sqrt(d): x / sqrt(sum x^2 + eps).
"""
from __future__ import annotations

from toygraph import ops
from toygraph.core.graph import Tensor
from toygraph.models.parts import DeltaNet

#: transformers' l2norm epsilon for q and k (fixed, not the model's rms_norm_eps).
L2_EPS = 1e-6


def _l2norm(x: Tensor, scale: float = 1.0) -> Tensor:
    d = x.shape[-1]
    return ops.scale(ops.rms_norm(x, L2_EPS / d), scale * d ** -0.5)


def deltanet(b, s: DeltaNet, x: Tensor) -> Tensor:
    """Layer b.i's token mixer on the normed stream x [B * T, n_embd] -> [B * T, n_embd]
    (b: the layer's models/decoder.Block; its sequence ops run the conv and the delta
    rule, models/sequence.py)."""
    B, T = b.B, b.T
    nk, dk, nv, dv = s.k_heads, s.k_dim, s.v_heads, s.v_dim
    qkv = b.proj(x, "attn_qkv").reshape(B, T, s.channels)
    qkv = ops.silu(b.seq.conv(b.i, qkv, b.w("ssm_conv1d.weight")))
    q = _l2norm(ops.narrow(qkv, 0, nk * dk).reshape(B, T, nk, dk), dk ** -0.5)
    k = _l2norm(ops.narrow(qkv, nk * dk, nk * dk).reshape(B, T, nk, dk))
    v = ops.narrow(qkv, 2 * nk * dk, nv * dv).reshape(B, T, nv, dv)
    if nv > nk:  # value head m reads key head m % nk (the file's tiled order)
        q, k = (ops.expand(y.reshape(B, T, 1, nk, dk), (B, T, nv // nk, nk, dk)).reshape(B, T, nv, dk)
                for y in (q, k))
    beta = ops.sigmoid(b.proj(x, "ssm_beta")).reshape(B, T, nv)
    alpha = b.proj(x, "ssm_alpha") + b.w("ssm_dt.bias")
    g = (ops.softplus(alpha) * b.w("ssm_a")).reshape(B, T, nv)
    o = b.seq.delta(b.i, q, k, v, g, beta)
    z = b.proj(x, "attn_gate").reshape(B, T, nv, dv)
    o = b.norm(o, "ssm_norm") * ops.silu(z)
    return b.proj(o.reshape(B * T, nv * dv), "ssm_out")
