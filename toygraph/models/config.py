"""A GGUF's metadata turned into a checked `ModelConfig`, and the tensors it requires.

Everything here is bounded against the file before anything loops or allocates over it:
``block_count`` must match the ``blk.N.`` tensors present, head counts and widths must be
positive and consistent, epsilons and rope bases positive and finite. Every "<arch>."
metadata key must be one the family understands, and (models/config.check_tensors) every
tensor in the file must be one the graph consumes. Each failure is one GGUFError line.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from toygraph.errors import GGUFError
from toygraph.models.families import FAMILIES, ZERO_ONLY_KEYS, Family

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelConfig:
    """The numbers a decoder graph needs, read from (and checked against) a GGUF.

    Per-layer attention: ``windows[i]`` (0 = full causal attention, else the sliding
    window), ``rope_bases[i]`` and ``rope_scales[i]`` (linear scaling: positions times
    this, 1.0 = none).
    """

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rope_dims: int
    rope_mode: str      # "normal" | "neox"
    rms_eps: float
    n_vocab: int
    n_ctx: int
    tied_output: bool   # no output.weight: the LM head reuses token_embd.weight
    qkv_bias: bool      # attn_q/k/v have biases (qwen2)
    rope_freqs: bool = False          # rope_freqs.weight frequency factors (Llama 3.x)
    rope_scale: float = 1.0           # linear rope scaling on the file's-base layers
    sliding_window: int = 0
    attn_scale: float = 0.0           # softmax scale of q k^T
    embed_scale: float = 1.0          # token embeddings are multiplied by this
    windows: tuple[int, ...] = ()
    rope_bases: tuple[float, ...] = ()
    rope_scales: tuple[float, ...] = ()
    # Mixture of experts (Family.moe; models/moe.py): layers from n_dense_lead on route
    # each token to n_expert_used of n_expert experts of FFN width n_ff_exp.
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_dense_lead: int = 0             # leading_dense_block_count: plain FFNs of width n_ff
    expert_weights_norm: bool = False  # renormalise the chosen experts' weights to sum 1
    expert_weights_scale: float = 1.0  # the chosen experts' weights are multiplied by this
    # YaRN (rope.scaling.type yarn): per rotary pair, the divisor of its frequency; every
    # layer uses them, and attn_scale holds YaRN's magnitude scale squared.
    rope_yarn: tuple[float, ...] = ()

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s FFN is a mixture of experts."""
        return self.n_expert > 0 and i >= self.n_dense_lead


def _number(meta, path, key: str, kind, default=None, *, positive=True):
    """A scalar metadata value of ``kind`` (int or float), checked; ``default`` if absent."""
    value = meta(key)
    if value is None:
        if default is None:
            raise GGUFError(f"{path}: missing metadata key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (kind is int and not float(value).is_integer()):
        raise GGUFError(f"{path}: metadata {key!r} must be a{'n integer' if kind is int else ' number'}, "
                        f"found {value!r}")
    value = kind(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise GGUFError(f"{path}: metadata {key!r} must be positive and finite, found {value!r}")
    return value


def _blocks_present(tensor_names) -> int:
    """1 + the largest N of the file's ``blk.N.`` tensors (0 if none)."""
    ns = [int(m.group(1)) for m in map(_BLOCK.match, tensor_names) if m]
    return max(ns) + 1 if ns else 0


def _check_keys(meta, meta_keys, fam: Family, path) -> None:
    prefix = fam.arch + "."
    unknown = sorted(k[len(prefix):] for k in meta_keys
                     if k.startswith(prefix) and k[len(prefix):] not in fam.keys
                     and not (k[len(prefix):] in ZERO_ONLY_KEYS and meta(k) == 0))
    if unknown:
        raise GGUFError(f"{path}: metadata key {prefix + unknown[0]!r} is not understood for "
                        f"{fam.arch}: it may change the model's math, so toygraph refuses the file")


def _rope_scale(num, meta, path, k, fam: Family) -> tuple[str, float]:
    """(scaling type, llama.cpp's rope_freq_scale): 1/factor when ``rope.scaling.factor``
    (or the older ``rope.scale_linear``) is present; linear scaling is implemented, and
    YaRN for the families whose parity tests cover it (Family.yarn)."""
    kind = meta(k("rope.scaling.type"))
    known = (None, "none", "linear") + (("yarn",) if fam.yarn else ())
    if kind not in known:
        raise GGUFError(f"{path}: {k('rope.scaling.type')} = {kind!r} is not supported "
                        f"(only {' and '.join(repr(x) for x in known[2:])} rope scaling)")
    factor = num(k("rope.scaling.factor"), float, 0.0, positive=False)
    if factor == 0.0:
        factor = num(k("rope.scale_linear"), float, 0.0, positive=False)
    if factor < 0:
        raise GGUFError(f"{path}: metadata {k('rope.scaling.factor')!r} must be >= 0, found {factor}")
    return kind or "none", 1.0 if factor == 0.0 else 1.0 / factor


def _yarn(num, path, k, freq_scale: float, base: float, rope_dims: int, head_dim: int,
          n_ctx: int) -> tuple[tuple[float, ...], float]:
    """YaRN as llama.cpp computes it (ggml_rope_yarn_corr_dims, rope_yarn): the per-pair
    frequency divisors 1 / (freq_scale (1 - ramp) + ramp), ramp falling from 1 to 0 over
    the correction range [floor(dim(beta_fast)), ceil(dim(beta_slow))], and the magnitude
    scale attn_factor * (1 + 0.1 ln(1 / freq_scale)) of cos and sin. The range is floored
    and ceiled as llama.cpp does (transformers' "truncate": true; the GGUF has no key)."""
    for key, default in (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0),
                         ("yarn_log_multiplier", 0.0)):
        value = num(k(f"rope.scaling.{key}"), float, default, positive=False)
        if value != default:
            raise GGUFError(f"{path}: {k('rope.scaling.' + key)} = {value} is not supported "
                            f"(only {default})")
    if rope_dims != head_dim:
        raise GGUFError(f"{path}: YaRN with partial rotary dims ({rope_dims} of {head_dim}) "
                        "is not supported")
    orig = num(k("rope.scaling.original_context_length"), int, n_ctx)
    fast = num(k("rope.scaling.yarn_beta_fast"), float, 32.0)
    slow = num(k("rope.scaling.yarn_beta_slow"), float, 1.0)

    def corr_dim(rotations):
        return rope_dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(fast)))
    high = min(rope_dims - 1.0, math.ceil(corr_dim(slow)))
    factors = []
    for i in range(rope_dims // 2):
        ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        factors.append(1.0 / (freq_scale * (1.0 - ramp) + ramp))
    mscale = num(k("rope.scaling.attn_factor"), float, 1.0) * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    return tuple(factors), mscale


def _global_layers(num, fam: Family, k, n_layer: int, path) -> list[bool]:
    """Which layers attend to the whole causal past (the rest use the sliding window):
    llama.cpp's set_swa_pattern(period), layer i sliding iff i % period < period - 1."""
    if not fam.swa_period:
        return [True] * n_layer
    period = num(k("attention.sliding_window_pattern"), int, fam.swa_period, positive=False)
    if period < 0:
        raise GGUFError(f"{path}: metadata {k('attention.sliding_window_pattern')!r} must be >= 0, "
                        f"found {period}")
    return [period > 0 and i % period == period - 1 for i in range(n_layer)]


def _heads(num, k, n_embd: int, path) -> tuple[int, int, int, int]:
    """(n_head, n_head_kv, head_dim, rope_dims), each positive and mutually consistent."""
    n_head = num(k("attention.head_count"), int)
    n_head_kv = num(k("attention.head_count_kv"), int, n_head)
    if n_head % n_head_kv:
        raise GGUFError(f"{path}: attention.head_count_kv = {n_head_kv} does not divide "
                        f"attention.head_count = {n_head}")
    head_dim = num(k("attention.key_length"), int, max(n_embd // n_head, 1))
    if num(k("attention.value_length"), int, head_dim) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from attention.key_length "
                        "(not supported)")
    rope_dims = num(k("rope.dimension_count"), int, head_dim)
    if rope_dims > head_dim or rope_dims % 2:
        raise GGUFError(f"{path}: rope.dimension_count = {rope_dims} must be even and at most "
                        f"the head size {head_dim}")
    return n_head, n_head_kv, head_dim, rope_dims


def _experts(num, meta, fam: Family, k, n_layer: int, path) -> dict:
    """The ModelConfig fields of a mixture of experts (none for a dense family); every
    MoE key (families.MOE_KEYS) is used here or refused."""
    if not fam.moe:
        return {}
    n_expert = num(k("expert_count"), int)
    used = num(k("expert_used_count"), int)
    if used > n_expert:
        raise GGUFError(f"{path}: {k('expert_used_count')} = {used} exceeds "
                        f"{k('expert_count')} = {n_expert}")
    for key in ("expert_shared_count", "expert_shared_feed_forward_length"):
        if num(k(key), int, 0, positive=False):
            raise GGUFError(f"{path}: {k(key)} > 0: shared experts are not implemented "
                            f"for {fam.arch}")
    gating = num(k("expert_gating_func"), int, 1)
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise GGUFError(f"{path}: {k('expert_gating_func')} = {gating} is not supported "
                        "(only 1, softmax)")
    norm = meta(k("expert_weights_norm"))
    if norm is not None and not isinstance(norm, bool):
        raise GGUFError(f"{path}: metadata {k('expert_weights_norm')!r} must be a bool, found {norm!r}")
    lead = num(k("leading_dense_block_count"), int, 0, positive=False)
    if not 0 <= lead < n_layer:
        raise GGUFError(f"{path}: {k('leading_dense_block_count')} = {lead} must be in "
                        f"[0, block_count = {n_layer})")
    return dict(n_expert=n_expert, n_expert_used=used, n_dense_lead=lead,
                n_ff_exp=num(k("expert_feed_forward_length"), int),
                expert_weights_norm=fam.expert_weights_norm if norm is None else norm,
                expert_weights_scale=num(k("expert_weights_scale"), float, 1.0))


def read_config(meta, meta_keys, tensors: dict, path) -> ModelConfig:
    """Config of a GGUF from ``meta(key) -> value or None``, its key names, and its tensor
    index ``{name: numpy-order shape}``; every value bounded before use."""
    arch = meta("general.architecture")
    fam = FAMILIES.get(arch) if isinstance(arch, str) else None
    if fam is None:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} "
                        f"(supported: {', '.join(FAMILIES)})")
    _check_keys(meta, meta_keys, fam, path)
    k = lambda key: f"{arch}.{key}"  # noqa: E731

    def num(key, kind, default=None, *, positive=True):
        return _number(meta, path, key, kind, default, positive=positive)

    if "token_embd.weight" not in tensors or len(tensors["token_embd.weight"]) != 2:
        raise GGUFError(f"{path}: missing required tensor 'token_embd.weight'")
    n_layer = num(k("block_count"), int)
    present = _blocks_present(tensors)
    if n_layer != present:
        raise GGUFError(f"{path}: metadata {k('block_count')!r} is {n_layer}, but the file holds "
                        f"tensors for {present} blocks")
    n_embd = num(k("embedding_length"), int)
    n_head, n_head_kv, head_dim, rope_dims = _heads(num, k, n_embd, path)
    rope_base = num(k("rope.freq_base"), float, fam.default_rope_base)
    n_ctx = num(k("context_length"), int, 2048)
    kind, scale = _rope_scale(num, meta, path, k, fam)
    yarn, mscale = (), 1.0
    if kind == "yarn":
        yarn, mscale = _yarn(num, path, k, scale, rope_base, rope_dims, head_dim, n_ctx)
        scale = 1.0   # the interpolation is in the per-pair factors
    window = num(k("attention.sliding_window"), int, 0, positive=False) if fam.swa_period else 0
    if fam.swa_period and window <= 0:
        raise GGUFError(f"{path}: {arch} needs a positive {k('attention.sliding_window')}")
    swa_base = num(k("rope.freq_base_swa"), float, fam.swa_rope_base or rope_base)
    is_global = _global_layers(num, fam, k, n_layer, path)
    attn_scale = (n_embd // n_head if n_layer in fam.attn_scale_embd_layers else head_dim) ** -0.5
    # YaRN scales cos and sin by mscale, so every score q.k by mscale^2 (all dims rotate).
    attn_scale *= mscale * mscale
    experts = _experts(num, meta, fam, k, n_layer, path)
    # An all-MoE file's dense width is never used (Qwen3-MoE writes one anyway).
    dense_ff = not experts or experts["n_dense_lead"] > 0
    return ModelConfig(
        arch=arch, n_layer=n_layer, n_embd=n_embd,
        n_ff=num(k("feed_forward_length"), int, None if dense_ff else 0, positive=dense_ff),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        rope_base=rope_base, rope_dims=rope_dims, rope_mode=fam.rope_mode,
        # Required, as llama.cpp requires it (the two references' defaults differ).
        rms_eps=num(k("attention.layer_norm_rms_epsilon"), float),
        # The embedding's row count is what the weights actually hold.
        n_vocab=int(tensors["token_embd.weight"][0]),
        n_ctx=n_ctx,
        tied_output="output.weight" not in tensors,
        qkv_bias=fam.qkv_bias and "blk.0.attn_q.bias" in tensors,
        rope_freqs=fam.rope_freqs and "rope_freqs.weight" in tensors,
        rope_scale=scale, sliding_window=window, attn_scale=attn_scale,
        embed_scale=math.sqrt(n_embd) if fam.embed_scale_sqrt else 1.0,
        windows=tuple(0 if g else window for g in is_global),
        rope_bases=tuple(rope_base if g else swa_base for g in is_global),
        rope_scales=tuple(scale if g or fam.swa_rope_scaled else 1.0 for g in is_global),
        rope_yarn=yarn,
        **experts,
    )


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor block ``i`` has, with its numpy-order shape."""
    d, hd, fam = cfg.n_embd, cfg.head_dim, cfg.family
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    shapes = {"attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
              "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_norm.weight": (d,)}
    if cfg.moe_layer(i):  # the router and the experts stacked [experts, out, in]
        E, f = cfg.n_expert, cfg.n_ff_exp
        shapes.update({"ffn_gate_inp.weight": (E, d), "ffn_gate_exps.weight": (E, f, d),
                       "ffn_up_exps.weight": (E, f, d), "ffn_down_exps.weight": (E, d, f)})
        if fam.expert_bias:
            shapes.update({"ffn_gate_inp.bias": (E,), "ffn_gate_exps.bias": (E, f),
                           "ffn_up_exps.bias": (E, f), "ffn_down_exps.bias": (E, d)})
    else:
        shapes.update({"ffn_gate.weight": (cfg.n_ff, d), "ffn_up.weight": (cfg.n_ff, d),
                       "ffn_down.weight": (d, cfg.n_ff)})
    if cfg.qkv_bias:
        shapes.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if fam.o_bias:
        shapes["attn_output.bias"] = (d,)
    if fam.sinks:
        shapes["attn_sinks.weight"] = (cfg.n_head,)
    if fam.ffn_norm != "ffn_norm":
        shapes[fam.ffn_norm + ".weight"] = shapes.pop("ffn_norm.weight")
    if fam.qk_norm:
        shapes.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    if fam.post_norms:
        shapes.update({"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)})
    return {f"blk.{i}.{n}": s for n, s in shapes.items()}


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors outside the blocks, with their numpy-order shapes."""
    want = {"token_embd.weight": (cfg.n_vocab, cfg.n_embd), "output_norm.weight": (cfg.n_embd,)}
    if not cfg.tied_output:
        want["output.weight"] = (cfg.n_vocab, cfg.n_embd)
    if cfg.rope_freqs:
        want["rope_freqs.weight"] = (cfg.rope_dims // 2,)
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
