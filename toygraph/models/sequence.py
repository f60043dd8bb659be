"""How a layer's ops over the sequence run (the parts' builders call these):

- ``attention``: fused causal attention over the whole window (token-major q, k, v: the
  projections' rows, no permute around it), windowed and with sinks as the layer's part
  says, staying inside each packed segment;
- ``conv`` and ``delta``: the Gated DeltaNet's causal conv and delta rule from a zero
  state (models/deltanet.py).

Training and evaluation use this class. Generation (inference/kvcache.py, batched.py)
passes subclasses that write and read caches instead.
"""
from __future__ import annotations

from toygraph import ops
from toygraph.core.graph import Tensor
from toygraph.ops.flash_attention import TOKEN_MAJOR


class SequenceOps:
    def attention(self, i: int, part, q: Tensor, k: Tensor, v: Tensor, sinks, segments) -> Tensor:
        """Layer i's attention (part: its models/parts.Attention): q [B, T, H, hd], k and
        v [B, T, KV, hd] after norms and rope; sinks [H] or None; segments [B, T] or None.
        Returns [B, T, H, hd]. Fused: no [B, H, T, T] scores in memory, forward or backward."""
        return ops.attention(q, k, v, scale=part.scale, causal=True, window=part.window,
                             segments=segments, sinks=sinks, layout=TOKEN_MAJOR)

    def conv(self, i: int, x: Tensor, w: Tensor) -> Tensor:
        return ops.causal_conv1d(x, w)

    def delta(self, i: int, q, k, v, g, beta) -> Tensor:
        return ops.delta_rule(q, k, v, g, beta)
