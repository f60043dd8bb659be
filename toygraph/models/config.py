"""A GGUF's metadata turned into a checked `ModelConfig` (its list of layers), and the
tensors it requires.

Everything is bounded against the file before anything loops or allocates over it
(models/readers.py): ``block_count`` must match the ``blk.N.`` tensors present, head
counts and widths must be positive and consistent, epsilons and rope bases positive and
finite. Every "<arch>." metadata key must be one the family understands, and
(check_tensors) every tensor in the file must be one the graph consumes. Each failure is
one GGUFError line.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from toygraph.errors import GGUFError
from toygraph.models import readers
from toygraph.models.families import FAMILIES, Family
from toygraph.models.parts import (ROPE_FREQS, YARN_FACTORS, Attention, DeltaNet, Dense,
                                   Experts, Layer)

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder read from (and checked against) a GGUF: its ``layers`` (models/parts.py),
    one per block, and the parts around them: the token embedding (times
    ``embed_scale``), the final norm, the output head (``tied_output``: token_embd.weight
    reused), the final logits' soft cap (0: none), and YaRN's per-pair frequency divisors
    ``rope_yarn`` (the const YARN_FACTORS the layers' rope reads). The properties below
    summarise the layers for messages, checks and the tensors outside them (Gemma 4's
    per-layer input embeddings, ``ple_dim`` wide); what builds or sizes a layer reads the
    layer."""

    arch: str
    n_embd: int
    n_vocab: int
    n_ctx: int
    rms_eps: float
    tied_output: bool
    layers: tuple[Layer, ...]
    embed_scale: float = 1.0
    logit_softcap: float = 0.0
    rope_yarn: tuple[float, ...] = ()

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @property
    def n_layer(self) -> int:
        """The number of blocks: one layer each (the file's block_count, checked against
        its ``blk.N.`` tensors)."""
        return len(self.layers)

    @property
    def attention(self) -> tuple[Attention, ...]:
        """The attention parts, in layer order (the DeltaNet layers have none)."""
        return tuple(layer.attention for layer in self.layers if layer.attention)

    def uniform(self, what: str):
        """``what`` (heads, kv_heads, head_dim) of the attention layers, which must all have
        the same: a fact that varies by layer (Gemma 4's sliding and global layers) is read
        per layer, from ``layer.attention``, and asking for one value of it is an error."""
        values = {getattr(a, what) for a in self.attention}
        if len(values) != 1:
            raise GGUFError(f"{self.arch}: attention {what} varies by layer ({sorted(values)}); "
                            "read it per layer (layer.attention)")
        return values.pop()

    @property
    def n_head(self) -> int:
        return self.uniform("heads")

    @property
    def n_head_kv(self) -> int:
        return self.uniform("kv_heads")

    @property
    def head_dim(self) -> int:
        return self.uniform("head_dim")

    @property
    def ple_dim(self) -> int:
        """The width of Gemma 4's per-layer inputs (each layer's ``per_layer_input``, the
        same in every layer; 0: none), which the embedding tables outside the layers hold
        for all of them."""
        return self.layers[0].per_layer_input if self.layers else 0

    @property
    def n_ff(self) -> int:        # the first dense FFN's width (0: every FFN a mixture)
        return next((layer.ffn.width for layer in self.layers if isinstance(layer.ffn, Dense)), 0)

    @property
    def qkv_bias(self) -> bool:
        return any(a.bias for a in self.attention)

    @property
    def experts(self) -> Experts | None:
        """The layers' mixture of experts (the same in every MoE layer), or None."""
        return next((layer.ffn for layer in self.layers if isinstance(layer.ffn, Experts)), None)

    @property
    def n_expert(self) -> int:
        return self.experts.count if self.experts else 0

    @property
    def n_expert_used(self) -> int:
        return self.experts.used if self.experts else 0

    @property
    def n_ff_exp(self) -> int:
        return self.experts.width if self.experts else 0

    @property
    def ssm(self) -> DeltaNet | None:
        """The DeltaNet layers' sizes (the same in each), or None."""
        return next((layer.mixer for layer in self.layers if isinstance(layer.mixer, DeltaNet)),
                    None)

    @property
    def rope_freqs(self) -> bool:
        """Whether some layer reads the file's rope_freqs.weight."""
        return any(a.rope.factors == ROPE_FREQS for a in self.attention)


def _blocks_present(tensor_names) -> int:
    """1 + the largest N of the file's ``blk.N.`` tensors (0 if none)."""
    ns = [int(m.group(1)) for m in map(_BLOCK.match, tensor_names) if m]
    return max(ns) + 1 if ns else 0


def read_config(meta, meta_keys, tensors: dict, path) -> ModelConfig:
    """Config of a GGUF from ``meta(key) -> value or None``, its key names, and its tensor
    index ``{name: numpy-order shape}``; every value bounded before use."""
    arch = meta("general.architecture")
    fam = FAMILIES.get(arch) if isinstance(arch, str) else None
    if fam is None:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} "
                        f"(supported: {', '.join(FAMILIES)})")
    readers.check_keys(meta, meta_keys, fam, path)
    m = readers.Metadata(meta, arch, path)
    if "token_embd.weight" not in tensors or len(tensors["token_embd.weight"]) != 2:
        raise GGUFError(f"{path}: missing required tensor 'token_embd.weight'")
    n_layer = m.num("block_count", int)
    present = _blocks_present(tensors)
    if n_layer != present:
        raise GGUFError(f"{path}: metadata {m.key('block_count')!r} is {n_layer}, but the file "
                        f"holds tensors for {present} blocks")
    n_embd = m.num("embedding_length", int)
    n_ctx = m.num("context_length", int, 2048)
    layers, yarn = _layers(m, fam, n_layer, n_embd, n_ctx, tensors)
    return ModelConfig(
        arch=arch, n_embd=n_embd,
        # The embedding's row count is what the weights actually hold.
        n_vocab=int(tensors["token_embd.weight"][0]), n_ctx=n_ctx,
        # Required, as llama.cpp requires it (the two references' defaults differ).
        rms_eps=m.num("attention.layer_norm_rms_epsilon", float),
        tied_output="output.weight" not in tensors, layers=layers,
        embed_scale=math.sqrt(n_embd) if fam.embed_scale_sqrt else 1.0,
        logit_softcap=m.num("final_logit_softcapping", float, 0.0, positive=False),
        rope_yarn=yarn)


def _layers(m: readers.Metadata, fam: Family, n_layer: int, n_embd: int, n_ctx: int,
            tensors: dict) -> tuple[tuple[Layer, ...], tuple[float, ...]]:
    """The family's layer prototype filled in from the file, one per block, and YaRN's
    per-pair divisors (empty without YaRN): each part from its reader below."""
    is_global = readers.global_layers(m, fam, n_layer)
    attentions, yarn = _attentions(m, fam, n_layer, n_embd, n_ctx, tensors, is_global)
    recurrent, delta = readers.deltanet(m, n_layer) if fam.deltanet else ([False] * n_layer, None)
    ffns = _ffns(m, fam.layer.ffn, n_layer)
    # Gemma 4's per-layer input embeddings: where the family reads the key (its extra_keys)
    ple = m.num("embedding_length_per_layer_input", int, 0, positive=False) \
        if "embedding_length_per_layer_input" in fam.extra_keys else 0
    return tuple(replace(fam.layer, mixer=delta if recurrent[i] else attentions[i], ffn=ffns[i],
                         per_layer_input=ple) for i in range(n_layer)), yarn


def _attentions(m: readers.Metadata, fam: Family, n_layer: int, n_embd: int, n_ctx: int,
                tensors: dict, is_global: list[bool]) -> tuple[list[Attention], tuple[float, ...]]:
    """Each block's attention part (the recurrent blocks' go unused), and YaRN's divisors:
    heads and head size per layer, the sliding window on the sliding layers, the score
    scale, the bias where the file has one, which layers read another's keys and values
    (Gemma 4), and each layer's rope."""
    heads = readers.heads(m, n_embd, n_layer, is_global)
    ropes, yarn, mscale = _ropes(m, fam, n_ctx, heads, is_global, tensors)
    window = m.num("attention.sliding_window", int, 0, positive=False) if fam.sliding else 0
    if fam.sliding and window <= 0:
        raise GGUFError(f"{m.path}: {fam.arch} needs a positive "
                        f"{m.key('attention.sliding_window')}")
    attn = fam.layer.mixer
    scale = attn.scale if attn.scale is not None else \
        (n_embd // heads["n_head"] if n_layer in fam.attn_scale_embd_layers else heads["head"][0]) ** -0.5
    # YaRN scales cos and sin by mscale, so every score q.k by mscale^2 (all dims rotate).
    scale *= mscale * mscale
    sources = readers.kv_sources(m, fam, n_layer, is_global)
    bias = attn.bias and "blk.0.attn_q.bias" in tensors
    parts = []
    for i, g in enumerate(is_global):
        shares = sources[i] != i
        parts.append(replace(
            attn, heads=heads["n_head"], kv_heads=heads["kv"][i], head_dim=heads["head"][i],
            rope=ropes[i], scale=scale, window=0 if g else window, bias=bias,
            keys_as_values=(attn.keys_as_values and not shares
                            and f"blk.{i}.attn_v.weight" not in tensors),
            kv_from=sources[i] if shares else None))
    return parts, yarn


def _ropes(m: readers.Metadata, fam: Family, n_ctx: int, heads: dict, is_global: list[bool],
           tensors: dict) -> tuple[list, tuple[float, ...], float]:
    """Each layer's rope (its rotated dims, base, linear scale and frequency factors: the
    file's rope_freqs.weight, or YaRN's divisors), YaRN's divisors and its mscale (1.0
    without YaRN). A family's sliding layers may have a base of their own and no scaling."""
    proto = fam.layer.mixer.rope
    base = m.num("rope.freq_base", float, fam.default_rope_base)
    kind, scale = readers.rope_scale(m, fam)
    yarn, mscale = (), 1.0
    if kind == "yarn":
        yarn, mscale = readers.yarn(m, scale, base, heads["rope"][0], heads["head"][0], n_ctx)
        scale = 1.0   # the interpolation is in the per-pair factors
    swa_base = m.num("rope.freq_base_swa", float,
                     (fam.sliding.rope_base if fam.sliding else None) or base)
    has_freqs = fam.rope_freqs != "" and ROPE_FREQS in tensors
    ropes = []
    for i, g in enumerate(is_global):
        freqs = has_freqs and (fam.rope_freqs == "all" or g)
        ropes.append(replace(proto, dims=heads["rope"][i], base=base if g else swa_base,
                             scale=scale if g or fam.sliding.rope_scaled else 1.0,
                             factors=ROPE_FREQS if freqs else YARN_FACTORS if yarn else None))
    return ropes, yarn, mscale


def _ffns(m: readers.Metadata, proto, n_layer: int) -> list:
    """Each block's feed-forward part: a dense FFN of its own width, or the mixture of
    experts (whose file may keep its first blocks dense)."""
    moe, n_dense = (readers.experts(m, proto, n_layer) if isinstance(proto, Experts)
                    else (None, n_layer))
    # An all-MoE file's dense width is never used (Qwen3-MoE writes one anyway).
    dense_ff = n_dense > 0
    ffs = m.per_layer("feed_forward_length", n_layer, None if dense_ff else 0, positive=dense_ff)
    return [moe if i >= n_dense else Dense(ffs[i], proto.activation) for i in range(n_layer)]


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor block ``i`` has, with its numpy-order shape."""
    return {f"blk.{i}.{n}": s for n, s in cfg.layers[i].tensors(cfg.n_embd).items()}


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors outside the blocks, with their numpy-order shapes."""
    want = {"token_embd.weight": (cfg.n_vocab, cfg.n_embd), "output_norm.weight": (cfg.n_embd,)}
    if not cfg.tied_output:
        want["output.weight"] = (cfg.n_vocab, cfg.n_embd)
    if cfg.rope_freqs:
        dims = max(a.rope.dims for a in cfg.attention if a.rope.factors == ROPE_FREQS)
        want[ROPE_FREQS] = (dims // 2,)
    if cfg.ple_dim:
        width = cfg.n_layer * cfg.ple_dim
        want.update({"per_layer_token_embd.weight": (cfg.n_vocab, width),
                     "per_layer_model_proj.weight": (width, cfg.n_embd),
                     "per_layer_proj_norm.weight": (cfg.ple_dim,)})
    return want


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph of ``cfg`` consumes, with its numpy-order shape."""
    want = global_shapes(cfg)
    for i in range(cfg.n_layer):
        want.update(layer_shapes(cfg, i))
    return want


def check_tensors(cfg: ModelConfig, tensors: dict, path) -> dict[str, tuple[int, ...]]:
    """Every required tensor present with its shape, and nothing else in the file."""
    want = tensor_shapes(cfg)
    for name, shape in want.items():
        got = tensors.get(name)
        if got is None:
            raise GGUFError(f"{path}: missing required tensor {name!r}")
        if tuple(got) != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {tuple(got)}, expected {shape}")
    extra = [n for n in tensors if n not in want]
    if extra:
        raise GGUFError(f"{path}: tensor {extra[0]!r} is not used by the {cfg.arch} graph "
                        "(toygraph refuses to ignore it)")
    return want
