"""The attention part of a decoder layer, as graph ops::

    q, k, v = x Wq^T, x Wk^T, x Wv^T (+ biases)      [Wq's rows [q | gate] per head: out_gate]
    [q, k = q_norm(q), k_norm(k)];  [v = rms_norm(v)];  q, k = rope(q), rope(k)
    o = attention(q, k, v)                            (window, sinks: the layer's part)
    [o = o * sigmoid(gate)];  out = o Wo^T (+ bias)

q, k and v stay token-major (the projections' [B * T, heads * hd] rows seen as
[B, T, heads, hd]; norms and rope apply there), and the fused attention reads that layout,
its o reshaping straight into the output projection: no permute (a gather kernel each
way, forward and backward) around it. A layer that shares an earlier layer's keys and
values (Gemma 4's kv_from) takes them from that layer's build.
"""
from __future__ import annotations

from toygraph import ops
from toygraph.core.graph import Tensor
from toygraph.models.parts import Attention


def attention(b, a: Attention, x: Tensor) -> Tensor:
    """Layer b.i's attention on the normed stream x [B * T, n_embd] -> [B * T, n_embd]
    (b: the layer's models/decoder.Block; b.seq runs the attention itself)."""
    B, T, H, KV, hd = b.B, b.T, a.heads, a.kv_heads, a.head_dim

    def heads(y, n, qk_norm: str | None):   # [B * T, n * hd] -> [B, T, n, hd]
        y = y.reshape(B, T, n, hd)
        return b.norm(y, qk_norm) if qk_norm else y   # per-head RMSNorm, before rope

    def rope(y):
        r = a.rope
        return ops.rope(y, b.positions, dims=r.dims, base=r.base, mode=r.mode,
                        freq_scale=r.scale, freq_factors=b.weight(r.factors))

    q = b.proj(x, "attn_q")
    if a.out_gate:  # each head's projection is [q | gate]
        q = q.reshape(B, T, H, 2 * hd)
        gate = ops.narrow(q, hd, hd).reshape(B * T, H * hd)
        q = ops.narrow(q, 0, hd)
    q = rope(heads(q, H, "attn_q_norm" if a.qk_norm else None))
    if a.kv_from is None:
        kx = b.proj(x, "attn_k")
        k = rope(heads(kx, KV, "attn_k_norm" if a.qk_norm else None))
        v = heads(kx if a.keys_as_values else b.proj(x, "attn_v"), KV, None)
        if a.v_norm:  # RMSNorm of each value head, without a weight
            v = ops.rms_norm(v, b.eps)
        b.kv[b.i] = k, v
    else:
        k, v = b.kv[a.kv_from]
    o = b.seq.attention(b.i, a, q, k, v, b.get("attn_sinks.weight"), b.segments)
    o = o.reshape(B * T, H * hd)
    if a.out_gate:
        o = o * ops.sigmoid(gate)
    return b.proj(o, "attn_output")
