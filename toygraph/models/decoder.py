"""The one decoder graph builder, for every family in models/families.py, with LoRA wiring.

>>> g = Graph()                                                        # doctest: +SKIP
>>> net = build_decoder(g, cfg, WeightSource(gguf_model), batch=4, seq_len=128,
...                     lora=LoraConfig(targets=("q", "v"), rank=8, alpha=16))
>>> net.tokens, net.positions, net.logits   # inputs [4, 128] i32 and logits [512, vocab]

The graph is the model's list of layers (``cfg.layers``, models/parts.py) built one after
the other: each layer's parts by their builders (BUILDERS: models/attention.py,
deltanet.py, ffn.py, moe.py), the norms around them by ``_layer``. Nothing here reads the
family's name; a family's differences arrive as the parts of its layers.

``build_decoder(g, cfg, source, *, batch, seq_len, lora, options)`` takes the model's
parts (``cfg``, its layers), where its weights come from (``source``, a
:class:`WeightSource`: a GGUF's tensors, new random ones, or a decoder's built earlier on
the same graph), the graph's shape, the adapters on the targeted projections (``lora``,
a LoraConfig) and how to build it (``options``, :class:`BuildOptions`: stop before the
logits, packed rows, the inputs' names, how attention runs).

Weights keep their GGUF names and layout: a projection ``W`` is [n_out, n_in] and
``y = x W^T``. Q/K rows are in the order the GGUF stores them, so rope uses the mode the
family's GGUFs expect ("normal" for llama, "neox" for the others); converting to Hugging
Face's row order happens only at the adapter-export boundary (adapters.hf_row_order).
"""
from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from toygraph import ops
from toygraph.core.graph import Graph, Tensor
from toygraph.core.optimizer import hp_input
from toygraph.errors import GraphError
from toygraph.models.block import Block, build_block, embed, regions
from toygraph.models.config import global_shapes, layer_shapes, tensor_shapes
from toygraph.models.parts import ROPE_FREQS, YARN_FACTORS, DeltaNet
from toygraph.models.sequence import SequenceOps

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
# Tensors that describe the model rather than weigh it: frozen in every weight mode.
FIXED = (ROPE_FREQS,)


@dataclass(frozen=True)
class LoraConfig:
    """Adapters ``y = W x + (alpha / rank) * B (A x)``; A ~ N(0, init_scale) seeded, B = 0.

    These defaults are the only place the default LoRA shape, seed and init scale are
    written: RecipeOptions, the LoRA recipe and RunConfig (so the CLI) read them from here.

    The variants (PEFT's names in brackets): ``rslora`` scales by alpha / sqrt(rank)
    [use_rslora]; ``dora`` adds a trainable magnitude per output row, initialised to the
    row norms of W, and computes ``y = m / ||W + s B A||_row * (W x + s B A x)`` with the
    norm detached from the gradient as PEFT does [use_dora]; ``lora_plus_ratio`` (LoRA+) is the
    learning-rate multiplier of B (and of DoRA's magnitudes, as PEFT's
    create_loraplus_optimizer groups every 1-D tensor with B), A keeping the base rate;
    ``lora_dropout`` drops elements of each adapter's input x with that probability while
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
    lora_plus_ratio: float = 1.0
    lora_dropout: float = 0.0
    dropout_stream: int = 0

    def __post_init__(self):
        object.__setattr__(self, "targets", expand_targets(self.targets))
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        if bad or not self.targets:
            raise GraphError(f"LoRA targets must be a non-empty subset of {list(ALL_TARGETS)}, got {list(self.targets)}")
        if self.rank < 1:
            raise GraphError(f"LoRA rank must be >= 1, got {self.rank}")
        if not (self.lora_plus_ratio > 0 and np.isfinite(self.lora_plus_ratio)):
            raise GraphError(f"LoRA+ ratio must be > 0, got {self.lora_plus_ratio}")
        if not 0 <= self.lora_dropout < 1:
            raise GraphError(f"LoRA dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_dropout and self.dora:  # PEFT then drops DoRA's base term's input too
            raise GraphError("LoRA dropout together with DoRA is not supported")
        experts = [t for t in self.targets if t in EXPERT_TARGETS]
        if experts and (self.dora or self.lora_dropout):  # as PEFT's ParamWrapper refuses them
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
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
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


@dataclass(frozen=True)
class WeightSource:
    """Where a decoder's weight tensors come from.

    From a GGUF: ``model`` (a models/model.GGUFModel) in ``mode`` (WEIGHT_MODES: "frozen"
    consts in their block formats, "finetune" trainable f32 copies, "scratch" new random
    params drawn from ``seed``, which needs the model only for the tensors FIXED names).
    Or from a Decoder built earlier on the same graph: ``shared`` lends its weights and LoRA
    pairs (a second graph over the same parameters, with inputs of its own: generation
    beside training); ``reference_of`` builds a second forward pass over its inputs and
    weight tensors, making no new weights (DPO's reference model reads the same frozen
    base), its adapters, when ``lora`` is given, named ``reference.<weight>.lora_a/b``.
    ``model`` still serves DoRA's magnitudes of new adapters."""

    model: object = None
    mode: str = "frozen"
    seed: int = LoraConfig.seed
    shared: Decoder | None = None
    reference_of: Decoder | None = None

    def __post_init__(self):
        if self.mode not in WEIGHT_MODES:
            raise GraphError(f"weight mode must be one of {WEIGHT_MODES}, got {self.mode!r}")
        if self.shared is not None and self.reference_of is not None:
            raise GraphError("a decoder's weights are either shared or a reference pass's, "
                             "not both")
        if self.mode != "scratch" and self.model is None and self.earlier is None:
            raise GraphError(f"weight mode {self.mode!r} needs a GGUF model")

    @property
    def earlier(self) -> Decoder | None:
        """The decoder this one's weights come from, if any."""
        return self.shared or self.reference_of


@dataclass(frozen=True)
class BuildOptions:
    """How build_decoder builds the graph.

    - ``logits=False`` stops at ``net.hidden`` / ``net.head``: training graphs feed them to
      the fused ``ops.linear_cross_entropy``, so no [tokens, vocab] logits are built;
      :func:`lm_head` builds them when wanted.
    - ``packed`` adds the input ``net.segments`` [batch, seq_len] (sample packing):
      attention then stays inside each segment (toygraph.data.packing).
    - ``prefix`` names this graph's ``tokens``/``positions``/``segments`` inputs apart from
      another decoder's on the same graph.
    - ``sequence`` (models/sequence.SequenceOps): how attention and the DeltaNet's conv and
      delta rule run; generation with a cache passes its own (inference/kvcache.py)."""

    logits: bool = True
    packed: bool = False
    prefix: str = ""
    sequence: SequenceOps | None = None


def build_decoder(g: Graph, cfg, source: WeightSource, *, batch: int, seq_len: int,
                  lora: LoraConfig | None = None,
                  options: BuildOptions = BuildOptions()) -> Decoder:
    """The forward graph of ``cfg`` for ``batch`` sequences of ``seq_len`` tokens, its
    weights from ``source``, one layer of ``cfg.layers`` after the other (the arguments:
    module docstring)."""
    ref, prefix = source.reference_of, options.prefix
    _check_request(cfg, batch, seq_len, options.packed, ref)
    if ref is not None:   # its inputs and weights, new adapters
        net = Decoder(cfg, ref.tokens, ref.positions, None, ref.weights, segments=ref.segments)
    else:
        W = (source.shared.weights if source.shared else
             _make_weights(g, cfg, source.model, source.mode, source.seed))
        net = Decoder(cfg, g.input(prefix + "tokens", (batch, seq_len), "i32"),
                      g.input(prefix + "positions", (batch, seq_len), "i32"), None, W)
        if options.packed:
            net.segments = g.input(prefix + "segments", (batch, seq_len), "i32")
    proj = Projections(g, net, lora, source)
    h = embed(g, net, batch, seq_len, source.earlier)
    seq = options.sequence or SequenceOps()
    for start, stop in regions(cfg):   # one region per block (recompute.py; Gemma 4: joined)
        with g.region(f"blk.{start}" if stop == start + 1 else f"blk.{start}-{stop - 1}", h) as r:
            for i in range(start, stop):
                h = build_block(Block(net, i, proj, seq, batch, seq_len), cfg.layers[i], h)
            r.output = h
    net.hidden = ops.rms_norm(h, cfg.rms_eps, weight=net.weights["output_norm.weight"])
    net.head = net.weights["token_embd.weight" if cfg.tied_output else "output.weight"]
    if options.logits:
        net.logits = lm_head(net)
    return net


def _check_request(cfg, batch: int, seq_len: int, packed: bool, reference_of) -> None:
    if packed and any(isinstance(layer.mixer, DeltaNet) for layer in cfg.layers):
        raise GraphError(f"sample packing is not supported for {cfg.arch}: its recurrent "
                         "layers would carry state across the packed sequences")
    if seq_len > cfg.n_ctx:
        raise GraphError(f"sequence length {seq_len} exceeds the model's context length {cfg.n_ctx}")
    if batch < 1 or seq_len < 1:
        raise GraphError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}")
    if reference_of is not None and reference_of.tokens.shape != (batch, seq_len):
        raise GraphError(f"a reference pass must have its decoder's shape "
                         f"{reference_of.tokens.shape}, got {(batch, seq_len)}")


class Projections:
    """``proj(x, name)``: x [N, n_in] -> [N, n_out] through GGUF weight ``name`` (+ its
    bias, + its LoRA adapter when ``lora`` targets it: made here, or the source's shared
    decoder's); ``expert_adapter(name)``: an expert stack's (A, B, scaling) or None
    (models/moe.py)."""

    def __init__(self, g: Graph, net: Decoder, lora: LoraConfig | None, source: WeightSource):
        self.g, self.net, self.lora, self.model, self.shared = \
            g, net, lora, source.model, source.shared
        self.prefix = "reference." if source.reference_of else ""   # its adapters' names
        self.rng = np.random.default_rng(lora.seed) if lora else None
        self.wanted = {ALL_TARGETS[t] for t in lora.targets} if lora else set()
        _check_targets(net.cfg, self.wanted)

    def _pair(self, name: str):
        pair = (self.shared.lora[name] if self.shared else
                _lora_pair(self.g, self.prefix + name,
                           lora_shapes(self.net.cfg, name, self.lora.rank), self.lora, self.rng))
        self.net.lora[name] = pair
        return pair

    def __call__(self, x, name: str):
        lora, W = self.lora, self.net.weights
        w = W[name]
        y = ops.matmul(x, w, trans_b=True)
        bias = W.get(name.replace(".weight", ".bias"))
        adapted = name.split(".")[-2] in self.wanted
        if adapted:
            a, b = self._pair(name)
            xa = x
            if lora.lora_dropout:   # each module its own mask: the name's crc32 salts it
                xa = ops.dropout(x, hp_input(self.g), p=lora.lora_dropout,
                                 seed=lora.seed + (lora.dropout_stream << 20),
                                 salt=zlib.crc32((self.prefix + name).encode()))
            low = ops.matmul(xa, a, trans_b=True)   # x A^T [N, rank]
        if adapted and lora.dora:  # PEFT's DoRA: m / ||W + s B A|| * (W x + s B A x) + bias
            m = (self.shared.magnitudes[name] if self.shared else
                 _dora_magnitude(self.g, self.prefix + name, w, self.model))
            self.net.magnitudes[name] = m
            y = _add_lora(y, low, b, lora.scaling) * _dora_factor(w, a, b, m, lora.scaling)
            return y + bias if bias is not None else y
        if bias is not None:
            y = y + bias
        if adapted:
            y = _add_lora(y, low, b, lora.scaling)
        return y

    def expert_adapter(self, name: str):
        """The (A, B, scaling) of expert weight ``name`` ("blk.N.ffn_down_exps.weight",
        "blk.N.ffn_gate_up_exps.weight"), None when it is not a target."""
        if name.split(".")[-2] not in self.wanted:
            return None
        return (*self._pair(name), self.lora.scaling)


def lm_head(net: Decoder) -> Tensor:
    """The output logits [batch * seq_len, vocab] = hidden @ head^T, soft-capped where the
    model says so (Gemma 4: cap * tanh(logits / cap)). For generation and evaluation, and
    training on the CPU; ops.linear_cross_entropy (the fused head) has no soft cap."""
    logits = ops.matmul(net.hidden, net.head, trans_b=True)
    return ops.softcap(logits, net.cfg.logit_softcap) if net.cfg.logit_softcap else logits


def fused_head_loss(net: Decoder, h: Tensor, labels: Tensor, reduction: str) -> Tensor:
    """ops.linear_cross_entropy over the model's head (no [rows, vocab] logits), refused
    for a model that soft-caps its logits (Gemma 4): the fused op has no soft cap, so its
    loss would be another model's. The model's fact stays with the model; the op knows
    none."""
    if net.cfg.logit_softcap:
        raise GraphError(f"the fused head: {net.cfg.arch}'s logits are soft-capped at "
                         f"{net.cfg.logit_softcap}, and the fused head has no soft cap (use "
                         "lm_head + cross_entropy)")
    return ops.linear_cross_entropy(h, net.head, labels, reduction=reduction)
