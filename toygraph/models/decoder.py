"""The one decoder graph builder, for every family in models/families.py, with LoRA wiring.

>>> g = Graph()                                                        # doctest: +SKIP
>>> net = build_decoder(g, cfg, batch=4, seq_len=128, model=gguf_model,
...                     lora=LoraConfig(targets=("q", "v"), rank=8, alpha=16))
>>> net.tokens, net.positions, net.logits   # inputs [4, 128] i32 and logits [512, vocab]

Training graphs pass ``logits=False`` and feed ``net.hidden`` (the final-normed hidden
states [512, n_embd]) and ``net.head`` (the output weight [vocab, n_embd]) to the fused
``ops.linear_cross_entropy``, so no [tokens, vocab] logits are built; :func:`lm_head`
builds them when wanted.

Weights keep their GGUF names and layout: a projection ``W`` is [n_out, n_in] and
``y = x W^T``. Q/K rows are in the order the GGUF stores them, so rope uses the mode the
family's GGUFs expect ("normal" for llama, "neox" for the others); converting to Hugging
Face's row order happens only at the adapter-export boundary (adapters.hf_row_order).
The family's differences (q/k norms, post norms, activation, sliding windows, rope bases,
embedding scale) arrive as data in ``cfg`` (models/config.ModelConfig) and its Family.
"""
from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from toygraph.core import ops
from toygraph.core.graph import Graph, Tensor
from toygraph.core.ops.flash_attention import TOKEN_MAJOR
from toygraph.core.optimizer import hp_input
from toygraph.errors import GraphError
from toygraph.models.config import global_shapes, layer_shapes, tensor_shapes
from toygraph.models.deltanet import Recurrence, deltanet
from toygraph.models.moe import moe_ffn

# LoRA target short names -> GGUF projection names.
TARGETS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
           "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
# Qwen3.5's Gated DeltaNet projections (models/deltanet.py), targetable beside TARGETS.
DELTANET_TARGETS = {"qkv": "attn_qkv", "z": "attn_gate", "alpha": "ssm_alpha",
                    "beta": "ssm_beta", "ssm_out": "ssm_out"}
# Mixture-of-experts LoRA (models/moe.py): one A/B pair per expert, stacked (A [E, r, n_in],
# B [E, n_out, r]), applied to the tokens routed to that expert. The gate and up experts
# share one adapter as they share one parameter in transformers (gate_up_proj) and so one
# PEFT ParamWrapper: B A's rows are [gate rows; up rows]. "experts" names both.
EXPERT_TARGETS = {"gate_up_exps": "ffn_gate_up_exps", "down_exps": "ffn_down_exps"}
TARGET_GROUPS = {"experts": tuple(EXPERT_TARGETS)}
ALL_TARGETS = {**TARGETS, **DELTANET_TARGETS, **EXPERT_TARGETS}
WEIGHT_MODES = ("frozen", "finetune", "scratch")
# Gated FFN activations by Family.ffn: act(gate) * up; gpt-oss's alpha and limit are the
# constants llama.cpp's build_moe_ffn uses for LLM_FFN_SWIGLU_OAI_MOE (and transformers'
# GptOssConfig defaults; the GGUF has no key for them).
ACTIVATIONS = {"swiglu": ops.swiglu, "geglu": ops.geglu,
               "swiglu_oai": lambda gate, up: ops.swiglu_oai(gate, up, alpha=1.702, limit=7.0)}
# Tensors that describe the model rather than weigh it: frozen in every weight mode.
FIXED = ("rope_freqs.weight",)
#: The const holding ModelConfig.rope_yarn (YaRN's per-pair frequency divisors), made by
#: the builder beside the GGUF's weights (the file stores no such tensor).
YARN_FACTORS = "rope_yarn.factors"


@dataclass(frozen=True)
class LoraConfig:
    """Adapters ``y = W x + (alpha / rank) * B (A x)``; A ~ N(0, init_scale) seeded, B = 0.

    These defaults are the only place the default LoRA shape, seed and init scale are
    written: RecipeOptions, the LoRA recipe and RunConfig (so the CLI) read them from here.

    The variants (PEFT's names in brackets): ``rslora`` scales by alpha / sqrt(rank)
    [use_rslora]; ``dora`` adds a trainable magnitude per output row, initialised to the
    row norms of W, and computes ``y = m / ||W + s B A||_row * (W x + s B A x)`` with the
    norm detached from the gradient as PEFT does [use_dora]; ``plus_ratio`` (LoRA+) is the
    learning-rate multiplier of B (and of DoRA's magnitudes, as PEFT's
    create_loraplus_optimizer groups every 1-D tensor with B), A keeping the base rate;
    ``dropout`` drops elements of each adapter's input x with that probability while
    training, ``B A dropout(x)`` [lora_dropout] (ops.dropout: its own mask per module, keyed
    by the step in the hp row; ``dropout_stream`` tells data-parallel ranks apart)."""

    targets: tuple[str, ...] = ("q", "v")
    rank: int = 8
    alpha: float = 16.0
    seed: int = 42
    init_scale: float = 0.01
    # LoRA variants (issue 26 item 4)
    rslora: bool = False
    dora: bool = False
    plus_ratio: float = 1.0
    dropout: float = 0.0
    dropout_stream: int = 0

    def __post_init__(self):
        object.__setattr__(self, "targets", expand_targets(self.targets))
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        if bad or not self.targets:
            raise GraphError(f"LoRA targets must be a non-empty subset of {list(ALL_TARGETS)}, got {list(self.targets)}")
        if self.rank < 1:
            raise GraphError(f"LoRA rank must be >= 1, got {self.rank}")
        if not (self.plus_ratio > 0 and np.isfinite(self.plus_ratio)):
            raise GraphError(f"LoRA+ ratio must be > 0, got {self.plus_ratio}")
        if not 0 <= self.dropout < 1:
            raise GraphError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.dropout and self.dora:  # PEFT then drops DoRA's base term's input too
            raise GraphError("LoRA dropout together with DoRA is not supported")
        experts = [t for t in self.targets if t in EXPERT_TARGETS]
        if experts and (self.dora or self.dropout):  # as PEFT's ParamWrapper refuses them
            raise GraphError(f"LoRA on the experts ({', '.join(experts)}) supports neither "
                             f"DoRA nor dropout")

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, self.rslora)


def expand_targets(targets) -> tuple[str, ...]:
    """Target names with each group ("experts") replaced by its members, each name once."""
    return tuple(dict.fromkeys(x for t in targets for x in TARGET_GROUPS.get(t, (t,))))


def lora_scaling(alpha: float, rank: int, rslora: bool = False) -> float:
    """The factor of B A: alpha / rank, or alpha / sqrt(rank) for rsLoRA (PEFT's rule)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


@dataclass
class Decoder:
    """Handles into a built decoder graph."""

    cfg: object
    tokens: Tensor
    positions: Tensor
    logits: Tensor | None                            # [batch * seq_len, vocab]; None if not asked
    weights: dict[str, Tensor] = field(default_factory=dict)   # GGUF name -> const/param
    kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer -> its (k, v)
    per_layer_inputs: Tensor | None = None           # Gemma 4: [n_layer, B * T * ple_dim]
    layer_rows: list[Tensor] = field(default_factory=list)  # Gemma 4: one-hot [1, n_layer] each
    lora: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # GGUF weight -> (A, B)
    magnitudes: dict[str, Tensor] = field(default_factory=dict)  # DoRA: GGUF weight -> m [n_out]
    hidden: Tensor | None = None                     # final-normed states [batch * seq_len, n_embd]
    head: Tensor | None = None                       # output weight [vocab, n_embd] (maybe tied)
    segments: Tensor | None = None                   # packed rows: segment ids [batch, seq] i32

    @property
    def params(self) -> list[Tensor]:
        ps = [t for t in self.weights.values() if t.role == "param"]
        for name, (a, b) in self.lora.items():
            ps += [a, b] + ([self.magnitudes[name]] if name in self.magnitudes else [])
        return ps


def weight_names(cfg) -> list[str]:
    return list(tensor_shapes(cfg))


def weight_shape(cfg, name: str) -> tuple[int, ...]:
    """The numpy-order shape of a GGUF weight for ``cfg`` (used for random init)."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (layer_shapes(cfg, int(m.group(1))) if m else global_shapes(cfg))[name]


def lora_shapes(cfg, name: str, rank: int) -> tuple[tuple, tuple]:
    """Numpy shapes (A, B) of the adapter of weight ``name``: [r, n_in] and [n_out, r],
    or per expert [E, r, n_in] and [E, n_out, r] ("ffn_gate_up_exps": n_out = 2 * n_ff_exp,
    the gate's rows then the up's)."""
    if ".ffn_gate_up_exps." in name:
        E, f, d = weight_shape(cfg, name.replace("gate_up", "gate"))
        return (E, rank, d), (E, 2 * f, rank)
    *e, n_out, n_in = weight_shape(cfg, name)
    return (*e, rank, n_in), (*e, n_out, rank)


def _scratch_init(name: str, shape, rng) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith(".bias"):
        return np.zeros(shape, np.float32)
    return (rng.normal(size=shape) * 0.02).astype(np.float32)


def _make_weights(g: Graph, cfg, model, mode: str, seed: int) -> dict[str, Tensor]:
    if mode not in WEIGHT_MODES:
        raise GraphError(f"weight mode must be one of {WEIGHT_MODES}, got {mode!r}")
    if mode != "scratch" and model is None:
        raise GraphError(f"weight mode {mode!r} needs a GGUF model")
    rng = np.random.default_rng(seed)
    out = {}
    present = model.tensor_names() if model is not None else None
    for name, shape in tensor_shapes(cfg, present).items():
        if mode == "scratch" and name not in FIXED:
            out[name] = g.param(name, _scratch_init(name, shape, rng))
            continue
        if model is None:
            raise GraphError(f"{name} needs a GGUF model")
        w = model.tensor(name)
        if mode == "finetune" and name not in FIXED:  # a trainable f32 copy
            out[name] = g.param(name, w.dequantize())
        else:
            out[name] = g.const(name, w.raw, shape=w.shape, storage=w.qtype)
    if cfg.rope_yarn:
        out[YARN_FACTORS] = g.const(YARN_FACTORS, np.array(cfg.rope_yarn, np.float32))
    return out


def _add_lora(y, x_at, b, scaling: float):
    """y + scaling * (x A^T) B^T, the adapter's product adding y and its scale in its own
    epilogue (ops.matmul_add: on the bf16 GEMM no pass of its own over the output)."""
    return ops.matmul_add(y, x_at, b, alpha=scaling, trans_b=True)


def _lora_pair(g: Graph, name: str, shapes: tuple[tuple, tuple], lora: LoraConfig, rng):
    a = g.param(f"{name}.lora_a", (rng.normal(size=shapes[0]) * lora.init_scale).astype(np.float32))
    b = g.param(f"{name}.lora_b", np.zeros(shapes[1], np.float32))
    return a, b


def _dora_magnitude(g: Graph, name: str, w: Tensor, model) -> Tensor:
    """DoRA's magnitude vector, initialised as PEFT does: the norms of W's rows (PEFT's
    ``torch.linalg.norm(weight, dim=1)`` of the [n_out, n_in] weight; B = 0 at init)."""
    if model is None or w.role == "param":
        raise GraphError("DoRA needs the frozen GGUF base (LoRA recipe) to set its magnitudes")
    rows = model.tensor(w.name).dequantize().astype(np.float64)
    return g.param(name + ".lora_magnitude", np.sqrt((rows * rows).sum(1)).astype(np.float32))


def _dora_factor(w: Tensor, a: Tensor, b: Tensor, m: Tensor, scaling: float) -> Tensor:
    """m / ||W + s B A||_row [n_out], the norm detached (ops.inv_row_norm). The simplest
    correct path: W + s B A as one [n_out, n_in] f32 temporary per adapted weight per
    forward, which also makes the backends hold a block-format W decoded (CUDA keeps an
    f32 copy of it; numpy decodes it where it is read)."""
    return m * ops.inv_row_norm(w + ops.scale(ops.matmul(b, a), scaling))


def _check_targets(cfg, wanted: set[str]) -> None:
    """Every LoRA target names a weight of this model: 'gate'/'up'/'down' are the dense
    FFN's, which a mixture-of-experts layer does not have."""
    present = {name.split(".")[-2] for name in tensor_shapes(cfg)}
    if "ffn_gate_exps" in present:
        present.add("ffn_gate_up_exps")
    missing = sorted(wanted - present)
    if missing:
        short = [t for t, proj in ALL_TARGETS.items() if proj in missing]
        hint = (" (its FFNs are mixtures of experts: target q, k, v, o, experts)" if cfg.n_expert
                else "")
        raise GraphError(f"LoRA targets {short} name no weight of this {cfg.arch} model{hint}")


def build_decoder(g: Graph, cfg, *, batch: int, seq_len: int, model=None, weights: str = "frozen",
                  lora: LoraConfig | None = None, seed: int = LoraConfig.seed,
                  logits: bool = True, packed: bool = False, reference_of: Decoder | None = None, attend=None,
                  shared: Decoder | None = None, prefix: str = "",
                  recurrence: Recurrence | None = None) -> Decoder:
    """Build the forward graph of ``cfg`` for ``batch`` sequences of ``seq_len`` tokens;
    ``logits=False`` stops at ``net.hidden`` / ``net.head`` (see :func:`lm_head`).

    ``reference_of`` builds a second forward pass over that decoder's own inputs and
    weight tensors, making no new weights (DPO's reference model reads the same frozen
    base); its adapters, when ``lora`` is given, are named ``reference.<weight>.lora_a/b``.

    For generation with a KV cache (kvcache.py): ``attend(i, q, k, v, sinks)`` replaces
    layer i's fused causal attention (q [B, T, H, hd], k and v [B, T, KV, hd] after norms
    and rope: token-major, the projections' rows; sinks the layer's attention sinks [H] or
    None; returns [B, T, H, hd]); ``shared``, a Decoder built earlier on ``g``, lends its weights
    and LoRA pairs (a second graph over the same parameters), and ``prefix`` names this
    one's ``tokens``/``positions`` inputs apart from its.

    ``packed`` adds the input ``net.segments`` [batch, seq_len] (sample packing): attention
    then stays inside each segment (toygraph.data.packing).

    ``recurrence`` runs the Gated DeltaNet layers' sequence ops (models/deltanet.py; the
    KV cache passes its state-carrying one)."""
    if packed and cfg.recurrent:
        raise GraphError(f"sample packing is not supported for {cfg.arch}: its recurrent "
                         "layers would carry state across the packed sequences")
    recurrence = recurrence or Recurrence()
    if seq_len > cfg.n_ctx:
        raise GraphError(f"sequence length {seq_len} exceeds the model's context length {cfg.n_ctx}")
    if batch < 1 or seq_len < 1:
        raise GraphError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}")
    if reference_of is not None:
        if reference_of.tokens.shape != (batch, seq_len):
            raise GraphError(f"a reference pass must have its decoder's shape "
                             f"{reference_of.tokens.shape}, got {(batch, seq_len)}")
        W, tokens, positions = reference_of.weights, reference_of.tokens, reference_of.positions
    else:
        if weights != "scratch" and model is None and shared is None:
            raise GraphError(f"weight mode {weights!r} needs a GGUF model")
        W = shared.weights if shared else _make_weights(g, cfg, model, weights, seed)
        tokens = g.input(prefix + "tokens", (batch, seq_len), "i32")
        positions = g.input(prefix + "positions", (batch, seq_len), "i32")
    net = Decoder(cfg=cfg, tokens=tokens, positions=positions, logits=None, weights=W)
    if reference_of is not None:
        net.segments = reference_of.segments
    elif packed:
        net.segments = g.input(prefix + "segments", (batch, seq_len), "i32")
    lora_prefix = "" if reference_of is None else "reference."
    lora_rng = np.random.default_rng(lora.seed) if lora else None
    wanted = {ALL_TARGETS[t] for t in lora.targets} if lora else set()
    _check_targets(cfg, wanted)

    def linear(x, name: str):
        """x [N, n_in] -> [N, n_out] through weight ``name`` (+ bias, + LoRA)."""
        w = W[name]
        y = ops.matmul(x, w, trans_b=True)
        bias = W.get(name.replace(".weight", ".bias"))
        adapted = name.split(".")[-2] in wanted
        if adapted:
            a, b = (shared.lora[name] if shared else
                    _lora_pair(g, lora_prefix + name, lora_shapes(cfg, name, lora.rank), lora,
                               lora_rng))
            net.lora[name] = (a, b)
            xa = x
            if lora.dropout:   # each module its own mask: the name's crc32 salts it
                xa = ops.dropout(x, hp_input(g), p=lora.dropout,
                                 seed=lora.seed + (lora.dropout_stream << 20),
                                 salt=zlib.crc32((lora_prefix + name).encode()))
            low = ops.matmul(xa, a, trans_b=True)   # x A^T [N, rank]
        if adapted and lora.dora:  # PEFT's DoRA: m / ||W + s B A|| * (W x + s B A x) + bias
            m = (shared.magnitudes[name] if shared else
                 _dora_magnitude(g, lora_prefix + name, w, model))
            net.magnitudes[name] = m
            y = _add_lora(y, low, b, lora.scaling) * _dora_factor(w, a, b, m, lora.scaling)
            return y + bias if bias is not None else y
        if bias is not None:
            y = y + bias
        if adapted:
            y = _add_lora(y, low, b, lora.scaling)
        return y

    def expert_adapter(name: str):
        """The (A, B, scaling) of expert weight ``name`` ("blk.N.ffn_down_exps.weight",
        "blk.N.ffn_gate_up_exps.weight"), None when it is not a target (models/moe.py)."""
        if name.split(".")[-2] not in wanted:
            return None
        a, b = (shared.lora[name] if shared else
                _lora_pair(g, lora_prefix + name, lora_shapes(cfg, name, lora.rank), lora,
                           lora_rng))
        net.lora[name] = (a, b)
        return a, b, lora.scaling
    linear.expert_adapter = expert_adapter

    B, T, D = batch, seq_len, cfg.n_embd
    h = ops.get_rows(W["token_embd.weight"], net.tokens).reshape(B * T, D)
    if cfg.embed_scale != 1.0:
        h = ops.scale(h, cfg.embed_scale)
    if cfg.ple_dim:
        net.per_layer_inputs = _per_layer_inputs(net, cfg, h, B, T)
        earlier = shared or reference_of
        net.layer_rows = earlier.layer_rows if earlier else [
            g.const(f"per_layer_input.{i}", np.eye(cfg.n_layer, dtype=np.float32)[i:i + 1])
            for i in range(cfg.n_layer)]
    # Token-major q/k/v/o: the kernels read the projections' rows through strides, so no
    # permute (a gather each way, forward and backward) surrounds the attention.
    attend = attend or (lambda i, q, k, v, sinks: ops.attention(
        q, k, v, scale=cfg.attn_scale, causal=True, window=cfg.windows[i],
        segments=net.segments, sinks=sinks, layout=TOKEN_MAJOR))
    # One region per block: the unit activation checkpointing recomputes (recompute.py). A
    # region recomputes from its own input alone, so the blocks from the first whose keys
    # and values a later block reuses (Gemma 4) to the last form one region.
    sharing = [cfg.layer_kv_source(i) for i in range(cfg.n_layer) if cfg.layer_kv_source(i) != i]
    joined = min(sharing, default=cfg.n_layer)
    for start in list(range(joined)) + ([joined] if joined < cfg.n_layer else []):
        stop = start + 1 if start < joined else cfg.n_layer
        name = f"blk.{start}" if stop == start + 1 else f"blk.{start}-{stop - 1}"
        with g.region(name, h) as block:
            for i in range(start, stop):
                h = _block(net, cfg, i, h, linear, attend, B, T, recurrence)
            block.output = h
    h = ops.rms_norm(h, cfg.rms_eps, weight=W["output_norm.weight"])
    net.hidden = h
    net.head = W["token_embd.weight"] if cfg.tied_output else W["output.weight"]
    if cfg.logit_softcap:  # so the fused head (no soft cap) refuses it: see lm_head
        net.head.attrs["logit_softcap"] = cfg.logit_softcap
    if logits:
        net.logits = lm_head(net)
    return net


def _per_layer_inputs(net: Decoder, cfg, h: Tensor, B: int, T: int) -> Tensor:
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


def _block(net: Decoder, cfg, i: int, h: Tensor, linear, attend, B: int, T: int,
           recurrence: Recurrence) -> Tensor:
    """Decoder layer ``i`` on the residual stream h [B * T, n_embd] (see models/families.py
    for the layer's shape and which parts each family has)."""
    W, fam, p = net.weights, cfg.family, f"blk.{i}."
    H, KV, hd = cfg.n_head, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)

    def norm(x, name):  # the weight in the norm's kernel (ops/norm.py)
        return ops.rms_norm(x, cfg.rms_eps, weight=W[p + name + ".weight"])

    def heads(y, n, qk_norm: str | None):   # [B * T, n * hd] -> [B, T, n, hd]
        y = y.reshape(B, T, n, hd)
        if qk_norm:  # per-head RMSNorm over head_dim, before rope (Qwen3, Gemma 3)
            y = norm(y, qk_norm)
        return y

    def rope(y):
        dims, factors = cfg.layer_rope(i)
        return ops.rope(y, net.positions, dims=dims, base=cfg.rope_bases[i],
                        mode=cfg.rope_mode, freq_scale=cfg.rope_scales[i],
                        freq_factors=W["rope_freqs.weight"] if factors else W.get(YARN_FACTORS))

    x = norm(h, "attn_norm")
    if cfg.layer_recurrent(i):  # Qwen3.5: a Gated DeltaNet layer instead of attention
        h = h + deltanet(cfg, i, x, W, linear, B, T, recurrence)
        return _ffn(h, cfg, i, W, norm, linear, p)
    q = linear(x, p + "attn_q.weight")
    if fam.attn_output_gate:  # Qwen3.5: each head's projection is [q | gate]
        q = q.reshape(B, T, H, 2 * hd)
        gate = ops.narrow(q, hd, hd).reshape(B * T, H * hd)
        q = ops.narrow(q, 0, hd)
    q = rope(heads(q, H, "attn_q_norm" if fam.qk_norm else None))
    source = cfg.layer_kv_source(i)
    if source == i:
        kx = linear(x, p + "attn_k.weight")
        k = rope(heads(kx, KV, "attn_k_norm" if fam.qk_norm else None))
        # Gemma 4's global layers may have no attn_v: the key projection is the values.
        vx = linear(x, p + "attn_v.weight") if p + "attn_v.weight" in W else kx
        v = heads(vx, KV, None)
        if fam.v_norm:  # Gemma 4: RMSNorm of each value head, without a weight
            v = ops.rms_norm(v, cfg.rms_eps)
        net.kv[i] = k, v
    else:  # Gemma 4's last layers attend with an earlier layer's keys and values
        k, v = net.kv[source]
    # Fused by default: no [B, H, T, T] scores in memory, forward or backward.
    o = attend(i, q, k, v, W.get(p + "attn_sinks.weight")).reshape(B * T, H * hd)
    if fam.attn_output_gate:
        o = o * ops.sigmoid(gate)
    a = linear(o, p + "attn_output.weight")
    if fam.post_norms:
        a = norm(a, "post_attention_norm")
    h = _ffn(h + a, cfg, i, W, norm, linear, p)
    if cfg.ple_dim:  # Gemma 4: this layer's per-layer input, gated by the stream
        # Row i of [n_layer, ...] by a one-hot matmul: exact, and its gradient too.
        ple = ops.matmul(net.layer_rows[i], net.per_layer_inputs).reshape(B * T, cfg.ple_dim)
        gate = ops.gelu if fam.ffn == "geglu" else ops.silu
        r = linear(gate(linear(h, p + "inp_gate.weight")) * ple, p + "proj.weight")
        h = h + norm(r, "post_norm")
    if fam.layer_output_scale:
        h = h * W[p + "layer_output_scale.weight"]
    return h


def _ffn(h: Tensor, cfg, i: int, W: dict, norm, linear, p: str) -> Tensor:
    """The residual FFN half of layer i: h + [post_ffw_norm](ffn(ffn_norm(h))), the FFN
    dense (down(act(gate(x)) * up(x))) or a mixture of experts (models/moe.py)."""
    fam = cfg.family
    x = norm(h, fam.ffn_norm)
    act = ACTIVATIONS[fam.ffn]
    if cfg.moe_layer(i):
        f = moe_ffn(cfg, W, p, x, linear, act)
    else:
        f = linear(act(linear(x, p + "ffn_gate.weight"), linear(x, p + "ffn_up.weight")),
                   p + "ffn_down.weight")
    if fam.post_norms:
        f = norm(f, "post_ffw_norm")
    return h + f


def lm_head(net: Decoder) -> Tensor:
    """The output logits [batch * seq_len, vocab] = hidden @ head^T, soft-capped where the
    model says so (Gemma 4: cap * tanh(logits / cap)). For generation and evaluation, and
    training on the CPU; ops.linear_cross_entropy (the fused head) has no soft cap."""
    logits = ops.matmul(net.hidden, net.head, trans_b=True)
    return ops.softcap(logits, net.cfg.logit_softcap) if net.cfg.logit_softcap else logits
