"""The Llama-family forward graph (Llama, SmolLM2, Qwen2) in the DSL, with LoRA wiring.

>>> g = Graph()                                                        # doctest: +SKIP
>>> net = build_llama(g, cfg, batch=4, seq=128, model=gguf_model,
...                   lora=LoraConfig(targets=("q", "v"), rank=8, alpha=16))
>>> net.tokens, net.positions, net.logits   # inputs [4, 128] i32 and logits [512, vocab]

Training graphs pass ``logits=False`` and feed ``net.hidden`` (the final-normed hidden
states [512, n_embd]) and ``net.head`` (the output weight [vocab, n_embd]) to the fused
``ops.linear_cross_entropy``, so no [tokens, vocab] logits are built; :func:`lm_head`
builds them when wanted.

Weights keep their GGUF names and layout: a projection ``W`` is [n_out, n_in] and
``y = x W^T``. Q/K rows are in the order the GGUF stores them, so rope uses the mode the
architecture's GGUFs expect ("normal" for llama, "neox" for qwen2); converting to Hugging
Face's row order happens only at the adapter-export boundary (adapters.hf_row_order).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import ops
from ..errors import GraphError
from ..graph import Graph, Tensor

# LoRA target short names -> GGUF projection names.
TARGETS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
           "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
WEIGHT_MODES = ("frozen", "finetune", "scratch")


@dataclass(frozen=True)
class LoraConfig:
    """Adapters ``y = W x + (alpha / rank) * B (A x)``; A ~ N(0, init_scale) seeded, B = 0."""

    targets: tuple[str, ...] = ("q", "v")
    rank: int = 8
    alpha: float = 16.0
    seed: int = 42
    init_scale: float = 0.01

    def __post_init__(self):
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise GraphError(f"LoRA targets must be a non-empty subset of {list(TARGETS)}, got {list(self.targets)}")
        if self.rank < 1:
            raise GraphError(f"LoRA rank must be >= 1, got {self.rank}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class Llama:
    """Handles into a built Llama graph."""

    cfg: object
    tokens: Tensor
    positions: Tensor
    logits: Tensor | None                            # [batch * seq, vocab]; None if not asked
    weights: dict[str, Tensor] = field(default_factory=dict)   # GGUF name -> const/param
    lora: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # GGUF weight -> (A, B)
    hidden: Tensor | None = None                     # final-normed states [batch * seq, n_embd]
    head: Tensor | None = None                       # output weight [vocab, n_embd] (maybe tied)

    @property
    def params(self) -> list[Tensor]:
        ps = [t for t in self.weights.values() if t.role == "param"]
        for a, b in self.lora.values():
            ps += [a, b]
        return ps


def layer_weight_names(cfg, i: int) -> list[str]:
    names = [f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v",
                                              "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                                              "ffn_down")]
    if cfg.qkv_bias:
        names += [f"blk.{i}.attn_{n}.bias" for n in ("q", "k", "v")]
    return names


def weight_names(cfg) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tied_output:
        names.append("output.weight")
    for i in range(cfg.n_layer):
        names += layer_weight_names(cfg, i)
    return names


def weight_shape(cfg, name: str) -> tuple[int, ...]:
    """The numpy-order shape of a GGUF weight for ``cfg`` (used for random init)."""
    d, hd = cfg.n_embd, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if name.endswith(".bias"):
        return ({"attn_q": q, "attn_k": kv, "attn_v": kv}[base],)
    return {"token_embd": (cfg.n_vocab, d), "output": (cfg.n_vocab, d), "output_norm": (d,),
            "attn_norm": (d,), "ffn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d),
            "attn_v": (kv, d), "attn_output": (d, q), "ffn_gate": (cfg.n_ff, d),
            "ffn_up": (cfg.n_ff, d), "ffn_down": (d, cfg.n_ff)}[base]


def _make_weights(g: Graph, cfg, model, mode: str, seed: int) -> dict[str, Tensor]:
    if mode not in WEIGHT_MODES:
        raise GraphError(f"weight mode must be one of {WEIGHT_MODES}, got {mode!r}")
    rng = np.random.default_rng(seed)
    out = {}
    for name in weight_names(cfg):
        if mode == "scratch":
            shape = weight_shape(cfg, name)
            if name.endswith("norm.weight"):
                init = np.ones(shape, np.float32)
            elif name.endswith(".bias"):
                init = np.zeros(shape, np.float32)
            else:
                init = (rng.normal(size=shape) * 0.02).astype(np.float32)
            out[name] = g.param(name, init)
            continue
        w = model.tensor(name)
        if mode == "finetune":  # every weight becomes a trainable f32 copy
            out[name] = g.param(name, w.dequantize())
        else:
            out[name] = g.const(name, w.raw, shape=w.shape, storage=w.qtype)
    return out


def _lora_pair(g: Graph, name: str, n_in: int, n_out: int, lora: LoraConfig, rng):
    a = g.param(f"{name}.lora_a", (rng.normal(size=(lora.rank, n_in)) * lora.init_scale).astype(np.float32))
    b = g.param(f"{name}.lora_b", np.zeros((n_out, lora.rank), np.float32))
    return a, b


def build_llama(g: Graph, cfg, *, batch: int, seq: int, model=None, weights: str = "frozen",
                lora: LoraConfig | None = None, seed: int = 42, logits: bool = True) -> Llama:
    """Build the forward graph of ``cfg`` for ``batch`` sequences of ``seq`` tokens;
    ``logits=False`` stops at ``net.hidden`` / ``net.head`` (see :func:`lm_head`)."""
    if seq > cfg.n_ctx:
        raise GraphError(f"sequence length {seq} exceeds the model's context length {cfg.n_ctx}")
    if batch < 1 or seq < 1:
        raise GraphError(f"batch and seq must be >= 1, got {batch} and {seq}")
    if weights != "scratch" and model is None:
        raise GraphError(f"weight mode {weights!r} needs a GGUF model")
    W = _make_weights(g, cfg, model, weights, seed)
    net = Llama(cfg=cfg, tokens=g.input("tokens", (batch, seq), "i32"),
                positions=g.input("positions", (batch, seq), "i32"), logits=None, weights=W)
    lora_rng = np.random.default_rng(lora.seed) if lora else None
    wanted = {TARGETS[t] for t in lora.targets} if lora else set()

    def linear(x, name: str):
        """x [N, n_in] -> [N, n_out] through weight ``name`` (+ bias, + LoRA)."""
        w = W[name]
        y = ops.matmul(x, w, trans_b=True)
        bias = W.get(name.replace(".weight", ".bias"))
        if bias is not None:
            y = y + bias
        if name.split(".")[-2] in wanted:
            a, b = _lora_pair(g, name, w.shape[1], w.shape[0], lora, lora_rng)
            net.lora[name] = (a, b)
            low = ops.matmul(ops.matmul(x, a, trans_b=True), b, trans_b=True)
            y = y + ops.scale(low, lora.scaling)
        return y

    B, T, D = batch, seq, cfg.n_embd
    H, KV, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    h = ops.get_rows(W["token_embd.weight"], net.tokens).reshape(B * T, D)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        x = ops.rms_norm(h, cfg.rms_eps) * W[p + "attn_norm.weight"]

        def heads(y, n, rotate):
            y = y.reshape(B, T, n, hd)
            if rotate:
                y = ops.rope(y, net.positions, dims=cfg.rope_dims, base=cfg.rope_base,
                             mode=cfg.rope_mode)
            return y.permute(0, 2, 1, 3)  # [B, heads, T, hd]

        q = heads(linear(x, p + "attn_q.weight"), H, True)
        k = heads(linear(x, p + "attn_k.weight"), KV, True)
        v = heads(linear(x, p + "attn_v.weight"), KV, False)
        # Fused: no [B, H, T, T] scores in memory, forward or backward.
        o = ops.attention(q, k, v, scale=hd ** -0.5, causal=True)
        o = o.permute(0, 2, 1, 3).reshape(B * T, H * hd)
        h = h + linear(o, p + "attn_output.weight")
        x = ops.rms_norm(h, cfg.rms_eps) * W[p + "ffn_norm.weight"]
        ff = ops.swiglu(linear(x, p + "ffn_gate.weight"), linear(x, p + "ffn_up.weight"))
        h = h + linear(ff, p + "ffn_down.weight")
    h = ops.rms_norm(h, cfg.rms_eps) * W["output_norm.weight"]
    net.hidden = h
    net.head = W["token_embd.weight"] if cfg.tied_output else W["output.weight"]
    if logits:
        net.logits = lm_head(net)
    return net


def lm_head(net: Llama) -> Tensor:
    """The output logits [batch * seq, vocab] = hidden @ head^T (for generation and
    evaluation; a training loss uses ops.linear_cross_entropy on hidden and head instead)."""
    return ops.matmul(net.hidden, net.head, trans_b=True)
