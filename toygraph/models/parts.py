"""A decoder layer as data: its token mixer (attention, or a Gated DeltaNet) and its
feed-forward part (dense gated, or a mixture of experts), and the norms around them::

    x = attn_norm(h);  a = mixer(x);  [a = post_attention_norm(a)];  h = h + a
    x = <ffn_norm>(h); f = ffn(x);    [f = post_ffw_norm(f)];        h = h + f
    [h = h + post_norm(proj(act(inp_gate(h)) * per_layer_input))]     (Gemma 4)
    [h = h * layer_output_scale]                                      (Gemma 4)

A model is a list of these, one per block (``ModelConfig.layers``), read from the GGUF's
metadata by models/config.py. Everything that needs a per-layer fact reads it from that
list: the decoder builder composes the graph part by part (models/decoder.py BUILDERS:
attention.py, deltanet.py, ffn.py, moe.py), the file check and random init take each
layer's tensors from ``Layer.tensors``, and generation sizes its caches by it
(inference/kvcache.py, batched.py).

A family (models/families.py) describes its layers with these same classes, as
prototypes: the parts it has and their flags (q/k norms, biases, sinks, router, ...) set,
the numbers (heads, widths, windows, rope) left at their defaults for the reader to fill
in from the file. A flag in a prototype says what the family *may* have; the reader
keeps it on a layer where the file has it (q/k/v biases, Gemma 4's value projection).
"""
from __future__ import annotations

from dataclasses import dataclass

Shapes = dict[str, tuple[int, ...]]

#: The const holding YaRN's per-pair frequency divisors (ModelConfig.rope_yarn), made by
#: the builder beside the GGUF's weights (the file stores no such tensor).
YARN_FACTORS = "rope_yarn.factors"
#: The file's rope frequency factors (Llama 3.x; Gemma 4's partial rope on global layers).
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class Rope:
    """How a layer rotates q and k: ``mode`` "normal" (adjacent pairs; llama GGUFs store
    the q/k rows permuted for it) or "neox" (rotate-half), the first ``dims`` of each head
    (partial rope turns fewer than the head size), ``base``, linear ``scale`` (positions
    times it; 1 = none) and ``factors``: the const of per-pair frequency divisors it
    reads (ROPE_FREQS, YARN_FACTORS) or None."""

    mode: str = "neox"
    dims: int = 0
    base: float = 10000.0
    scale: float = 1.0
    factors: str | None = None


@dataclass(frozen=True)
class Attention:
    """Causal self-attention with ``heads`` query heads sharing ``kv_heads`` key/value
    heads of ``head_dim``; ``window`` 0 (full) or the sliding window; ``scale`` the
    softmax scale of q.k (None in a prototype: 1/sqrt(head_dim), the reader's rule).

    ``qk_norm``: per-head RMSNorm of q and k before rope (attn_q_norm / attn_k_norm);
    ``v_norm``: RMSNorm of each value head without a weight (Gemma 4); ``bias``: attn_q/k/v
    biases; ``out_bias``: attn_output's; ``sinks``: per-head attention sinks
    (attn_sinks.weight, gpt-oss); ``out_gate``: attn_q holds [q | gate] per head and the
    output is o * sigmoid(gate) (Qwen3.5); ``keys_as_values``: no attn_v, the key
    projection is the values (Gemma 4's global layers); ``kv_from``: the earlier layer
    whose keys and values this one attends with (Gemma 4's KV sharing), None: its own."""

    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    rope: Rope = Rope()
    scale: float | None = None
    window: int = 0
    qk_norm: bool = False
    v_norm: bool = False
    bias: bool = False
    out_bias: bool = False
    sinks: bool = False
    out_gate: bool = False
    keys_as_values: bool = False
    kv_from: int | None = None

    def tensors(self, d: int) -> Shapes:
        hd, own = self.head_dim, self.kv_from is None
        q, kv = self.heads * hd, self.kv_heads * hd
        out = {"attn_q.weight": (q * (1 + self.out_gate), d)}
        if own:
            out["attn_k.weight"] = (kv, d)
            if not self.keys_as_values:
                out["attn_v.weight"] = (kv, d)
        out["attn_output.weight"] = (d, q)
        if self.bias:
            out["attn_q.bias"] = (q,)
            if own:
                out.update({"attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if self.out_bias:
            out["attn_output.bias"] = (d,)
        if self.sinks:
            out["attn_sinks.weight"] = (self.heads,)
        if self.qk_norm:
            out.update({"attn_q_norm.weight": (hd,)} if not own else
                       {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        return out


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet token mixer (Qwen3.5, models/deltanet.py): conv kernel width, key
    heads and their size (the state's rows), value heads and their size (its columns)."""

    conv: int = 0
    k_heads: int = 0
    k_dim: int = 0
    v_heads: int = 0
    v_dim: int = 0

    @property
    def channels(self) -> int:  # the conv's q | k | v channels
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def tensors(self, d: int) -> Shapes:
        inner, n = self.v_heads * self.v_dim, self.v_heads
        return {"attn_qkv.weight": (self.channels, d), "attn_gate.weight": (inner, d),
                "ssm_alpha.weight": (n, d), "ssm_beta.weight": (n, d), "ssm_a": (n,),
                "ssm_dt.bias": (n,), "ssm_conv1d.weight": (self.channels, self.conv),
                "ssm_norm.weight": (self.v_dim,), "ssm_out.weight": (d, inner)}


@dataclass(frozen=True)
class Dense:
    """A gated feed-forward part, down(act(gate(x)) * up(x)) of ``width``; ``activation``
    one of models/ffn.ACTIVATIONS; ``suffix`` names its tensors (ffn_gate<suffix>, ...):
    "" for a layer's FFN, "_shexp" for a mixture's shared expert."""

    width: int = 0
    activation: str = "swiglu"
    suffix: str = ""

    def tensors(self, d: int) -> Shapes:
        s, f = self.suffix, self.width
        return {f"ffn_gate{s}.weight": (f, d), f"ffn_up{s}.weight": (f, d),
                f"ffn_down{s}.weight": (d, f)}


@dataclass(frozen=True)
class Experts:
    """A mixture of ``count`` experts of ``width``, ``used`` per token (models/moe.py):
    router ``ffn_gate_inp``, experts stacked ``ffn_{gate,up,down}_exps``. ``router``
    "softmax_topk" or "topk_softmax" (moe.route), ``norm_weights`` renormalises the chosen
    experts' weights to sum 1, ``weights_scale`` multiplies them; ``bias``: the router and
    the experts have biases (gpt-oss); ``shared``: a dense expert every token goes through,
    its output gated by sigmoid(x ffn_gate_inp_shexp) (Qwen2-MoE), or None."""

    count: int = 0
    used: int = 0
    width: int = 0
    activation: str = "swiglu"
    router: str = "softmax_topk"
    norm_weights: bool = False
    weights_scale: float = 1.0
    bias: bool = False
    shared: Dense | None = None

    def tensors(self, d: int) -> Shapes:
        E, f = self.count, self.width
        out = {"ffn_gate_inp.weight": (E, d), "ffn_gate_exps.weight": (E, f, d),
               "ffn_up_exps.weight": (E, f, d), "ffn_down_exps.weight": (E, d, f)}
        if self.bias:
            out.update({"ffn_gate_inp.bias": (E,), "ffn_gate_exps.bias": (E, f),
                        "ffn_up_exps.bias": (E, f), "ffn_down_exps.bias": (E, d)})
        if self.shared is not None:
            out.update({"ffn_gate_inp_shexp.weight": (1, d), **self.shared.tensors(d)})
        return out


@dataclass(frozen=True)
class Layer:
    """One block: its ``mixer`` and ``ffn`` parts and the norms around them (module
    docstring). ``ffn_norm``: the name of the RMSNorm before the FFN (gpt-oss's and
    Qwen3.5's GGUFs call it post_attention_norm); ``post_norms``: RMSNorms of the mixer's
    and the FFN's outputs before each residual add; ``per_layer_input``: the width of
    Gemma 4's per-layer input this block adds (0: none); ``output_scale``: the block's
    output times its layer_output_scale scalar."""

    mixer: Attention | DeltaNet
    ffn: Dense | Experts
    ffn_norm: str = "ffn_norm"
    post_norms: bool = False
    per_layer_input: int = 0
    output_scale: bool = False

    @property
    def attention(self) -> Attention | None:
        return self.mixer if isinstance(self.mixer, Attention) else None

    def tensors(self, d: int) -> Shapes:
        """Every tensor of the block (names after ``blk.N.``) with its numpy-order shape,
        in the order the builder makes them (and random init draws them)."""
        out = {"attn_norm.weight": (d,), **self.mixer.tensors(d)}
        if self.post_norms:
            out["post_attention_norm.weight"] = (d,)
        out[self.ffn_norm + ".weight"] = (d,)
        out.update(self.ffn.tensors(d))
        if self.post_norms:
            out["post_ffw_norm.weight"] = (d,)
        if self.per_layer_input:
            p = self.per_layer_input
            out.update({"inp_gate.weight": (p, d), "proj.weight": (d, p), "post_norm.weight": (d,)})
        if self.output_scale:
            out["layer_output_scale.weight"] = (1,)
        return out
