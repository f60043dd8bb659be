"""One block of the decoder, built from its layer description (models/parts.py): each
part by its builder (BUILDERS), the norms and residual adds around them here; and the
pieces around the blocks, the token embedding and its recompute regions."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toygraph import ops
from toygraph.core.graph import Graph, Tensor
from toygraph.models.attention import attention
from toygraph.models.deltanet import deltanet
from toygraph.models.ffn import GATES, dense_ffn
from toygraph.models.moe import moe_ffn
from toygraph.models.parts import Attention, DeltaNet, Dense, Experts, Layer
from toygraph.models.sequence import SequenceOps


@dataclass
class Block:
    """Layer ``i``'s view of the graph being built: what its parts' builders read
    (models/attention.py, deltanet.py, ffn.py, moe.py)."""

    net: object                  # the models/decoder.Decoder being built
    i: int
    projections: object          # models/decoder.Projections: proj(x, name), expert_adapter
    seq: SequenceOps             # how attention, conv and delta run (models/sequence.py)
    B: int
    T: int

    @property
    def eps(self) -> float:
        return self.net.cfg.rms_eps

    @property
    def positions(self) -> Tensor:
        return self.net.positions

    @property
    def segments(self) -> Tensor | None:
        return self.net.segments

    @property
    def kv(self) -> dict:        # layer -> its (k, v), for the layers that share them
        return self.net.kv

    def w(self, name: str) -> Tensor:
        """This layer's tensor ``blk.<i>.<name>``."""
        return self.net.weights[f"blk.{self.i}.{name}"]

    def get(self, name: str) -> Tensor | None:
        return self.net.weights.get(f"blk.{self.i}.{name}")

    def weight(self, name: str | None) -> Tensor | None:
        """A tensor outside the blocks by its full name (None: None)."""
        return None if name is None else self.net.weights[name]

    def proj(self, x: Tensor, name: str) -> Tensor:
        return self.projections(x, f"blk.{self.i}.{name}.weight")

    def expert_adapter(self, name: str):
        return self.projections.expert_adapter(f"blk.{self.i}.{name}.weight")

    def norm(self, x: Tensor, name: str) -> Tensor:   # the weight in the norm's kernel
        return ops.rms_norm(x, self.eps, weight=self.w(name + ".weight"))


#: The builder of each part (models/parts.py): builder(block, part, x) -> Tensor.
BUILDERS = {Attention: attention, DeltaNet: deltanet, Dense: dense_ffn, Experts: moe_ffn}


def build_block(b: Block, layer: Layer, h: Tensor) -> Tensor:
    """One block on the residual stream h [B * T, n_embd] (models/parts.py's layer)."""
    a = BUILDERS[type(layer.mixer)](b, layer.mixer, b.norm(h, "attn_norm"))
    if layer.post_norms:
        a = b.norm(a, "post_attention_norm")
    h = h + a
    f = BUILDERS[type(layer.ffn)](b, layer.ffn, b.norm(h, layer.ffn_norm))
    if layer.post_norms:
        f = b.norm(f, "post_ffw_norm")
    h = h + f
    if layer.per_layer_input:  # Gemma 4: this layer's per-layer input, gated by the stream
        # Row i of [n_layer, ...] by a one-hot matmul: exact, and its gradient too.
        ple = ops.matmul(b.net.layer_rows[b.i], b.net.per_layer_inputs)
        ple = ple.reshape(b.B * b.T, layer.per_layer_input)
        r = b.proj(GATES[layer.ffn.activation](b.proj(h, "inp_gate")) * ple, "proj")
        h = h + b.norm(r, "post_norm")
    if layer.output_scale:
        h = h * b.w("layer_output_scale.weight")
    return h


def regions(cfg) -> list[tuple[int, int]]:
    """The blocks' [start, stop) recompute regions (recompute.py): one per block, except
    that a region recomputes from its own input alone, so the blocks from the first whose
    keys and values a later block reuses (Gemma 4) to the last form one region."""
    sharing = [a.kv_from for a in cfg.attention if a.kv_from is not None]
    joined = min(sharing, default=cfg.n_layer)
    return [(i, i + 1) for i in range(joined)] + \
        ([(joined, cfg.n_layer)] if joined < cfg.n_layer else [])


def embed(g: Graph, net, B: int, T: int, earlier) -> Tensor:
    """The (scaled) token embeddings [B * T, n_embd]; Gemma 4's per-layer inputs beside."""
    cfg = net.cfg
    h = ops.get_rows(net.weights["token_embd.weight"], net.tokens).reshape(B * T, cfg.n_embd)
    if cfg.embed_scale != 1.0:
        h = ops.scale(h, cfg.embed_scale)
    if cfg.ple_dim:
        net.per_layer_inputs = _per_layer_inputs(net, cfg, h, B, T)
        net.layer_rows = earlier.layer_rows if earlier else [
            g.const(f"per_layer_input.{i}", np.eye(cfg.n_layer, dtype=np.float32)[i:i + 1])
            for i in range(cfg.n_layer)]
    return h


def _per_layer_inputs(net, cfg, h: Tensor, B: int, T: int) -> Tensor:
    """Gemma 4's per-layer inputs, all layers at once, as rows [n_layer, B * T * ple_dim]:
    (rms_norm(h W_proj^T / sqrt(n_embd)) * w + E_ple[tokens] * sqrt(ple_dim)) / sqrt(2),
    h the scaled token embeddings (transformers' project_per_layer_inputs)."""
    W, L, P, N = net.weights, cfg.n_layer, cfg.ple_dim, B * T
    tok = ops.get_rows(W["per_layer_token_embd.weight"], net.tokens).reshape(N, L, P)
    proj = ops.matmul(h, W["per_layer_model_proj.weight"], trans_b=True).reshape(N, L, P)
    proj = ops.rms_norm(ops.scale(proj, cfg.n_embd ** -0.5), cfg.rms_eps,
                        weight=W["per_layer_proj_norm.weight"])
    both = ops.scale(proj + ops.scale(tok, P ** 0.5), 0.5 ** 0.5)
    return ops.contiguous(both.permute(1, 0, 2)).reshape(L, N * P)
