"""The part readers: each reads one kind of fact about the layers from a GGUF's metadata,
checked and bounded before anything loops or allocates over it (models/config.py
read_config puts them together into the layer list). Each failure is one GGUFError line.
"""
from __future__ import annotations

import math

from toygraph.errors import GGUFError
from toygraph.models.families import ZERO_ONLY_KEYS, Family
from toygraph.models.parts import DeltaNet, Dense, Experts


class Metadata:
    """One file's ``<arch>.`` metadata: ``raw(key)`` the value or None, ``num(key, kind)``
    a checked scalar, ``per_layer(key)`` one integer per layer (keys after "<arch>.")."""

    def __init__(self, meta, arch: str, path):
        self.meta, self.arch, self.path = meta, arch, path

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def raw(self, name: str):
        return self.meta(self.key(name))

    def num(self, name: str, kind, default=None, *, positive=True):
        return number(self.meta, self.path, self.key(name), kind, default, positive=positive)

    def per_layer(self, name: str, n_layer: int, default: int | None, *,
                  positive=True) -> tuple[int, ...]:
        """An integer per layer: one value for all, or llama.cpp's array of n_layer values."""
        key, value = self.key(name), self.raw(name)
        if isinstance(value, (list, tuple)):
            if len(value) != n_layer:
                raise GGUFError(f"{self.path}: metadata {key!r} has {len(value)} values for "
                                f"{n_layer} layers")
            return tuple(number(lambda _key, v=v: v, self.path, key, int, positive=positive)
                         for v in value)
        return (number(self.meta, self.path, key, int, default, positive=positive),) * n_layer

    def flags(self, name: str, n_layer: int, what: str) -> list[bool] | None:
        """The key's per-layer booleans, None when it holds something else."""
        value = self.raw(name)
        if not isinstance(value, (list, tuple)):
            return None
        if len(value) != n_layer or not all(isinstance(f, bool) for f in value):
            raise GGUFError(f"{self.path}: metadata {self.key(name)!r} must be {what}"
                            f"{n_layer} booleans, found {value!r}")
        return list(value)


def number(meta, path, key: str, kind, default=None, *, positive=True):
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


def check_keys(meta, meta_keys, fam: Family, path) -> None:
    prefix = fam.arch + "."
    unknown = sorted(k[len(prefix):] for k in meta_keys
                     if k.startswith(prefix) and k[len(prefix):] not in fam.keys
                     and not (k[len(prefix):] in ZERO_ONLY_KEYS and meta(k) == 0))
    if unknown:
        raise GGUFError(f"{path}: metadata key {prefix + unknown[0]!r} is not understood for "
                        f"{fam.arch}: it may change the model's math, so toygraph refuses the file")


def rope_scale(m: Metadata, fam: Family) -> tuple[str, float]:
    """(scaling type, llama.cpp's rope_freq_scale), read as llama.cpp reads them: an absent
    type is "linear"; "none" never scales, whatever the factor; else 1/factor, a factor of
    0 meaning 1, the older ``rope.scale_linear`` read only when ``rope.scaling.factor`` is
    absent. Linear scaling is implemented, and YaRN for the families whose parity tests
    cover it (Family.yarn)."""
    kind = m.raw("rope.scaling.type")
    known = (None, "none", "linear") + (("yarn",) if fam.yarn else ())
    if kind not in known:
        raise GGUFError(f"{m.path}: {m.key('rope.scaling.type')} = {kind!r} is not supported "
                        f"(only {' and '.join(repr(x) for x in known[2:])} rope scaling)")
    name = "rope.scaling.factor" if m.raw("rope.scaling.factor") is not None else "rope.scale_linear"
    factor = m.num(name, float, 0.0, positive=False)
    if factor < 0:
        raise GGUFError(f"{m.path}: metadata {m.key(name)!r} must be >= 0, found {factor}")
    attn_factor = m.num("rope.scaling.attn_factor", float, 1.0)
    if kind != "yarn" and attn_factor != 1.0:   # llama.cpp scales cos and sin by it
        raise GGUFError(f"{m.path}: {m.key('rope.scaling.attn_factor')} = {attn_factor} is "
                        "not supported without YaRN (only 1)")
    kind = kind or "linear"
    return kind, 1.0 if factor == 0.0 or kind == "none" else 1.0 / factor


def yarn(m: Metadata, freq_scale: float, base: float, rope_dims: int, head_dim: int,
         n_ctx: int) -> tuple[tuple[float, ...], float]:
    """YaRN as llama.cpp computes it (ggml_rope_yarn_corr_dims, rope_yarn): the per-pair
    frequency divisors 1 / (freq_scale (1 - ramp) + ramp), ramp falling from 1 to 0 over
    the correction range [floor(dim(beta_fast)), ceil(dim(beta_slow))], and the magnitude
    scale attn_factor * (1 + 0.1 ln(1 / freq_scale)) of cos and sin. The range is floored
    and ceiled as llama.cpp does (transformers' "truncate": true; the GGUF has no key)."""
    for key, default in (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0),
                         ("yarn_log_multiplier", 0.0)):
        value = m.num(f"rope.scaling.{key}", float, default, positive=False)
        if value != default:
            raise GGUFError(f"{m.path}: {m.key('rope.scaling.' + key)} = {value} is not "
                            f"supported (only {default})")
    if rope_dims != head_dim:
        raise GGUFError(f"{m.path}: YaRN with partial rotary dims ({rope_dims} of {head_dim}) "
                        "is not supported")
    # llama.cpp's n_ctx_orig_yarn: 0 (or absent) means the training context
    orig = m.num("rope.scaling.original_context_length", int, 0, positive=False) or n_ctx
    if orig < 0:
        raise GGUFError(f"{m.path}: metadata {m.key('rope.scaling.original_context_length')!r} "
                        f"must be >= 0, found {orig}")
    fast = m.num("rope.scaling.yarn_beta_fast", float, 32.0)
    slow = m.num("rope.scaling.yarn_beta_slow", float, 1.0)

    def corr_dim(rotations):
        return rope_dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(fast)))
    high = min(rope_dims - 1.0, math.ceil(corr_dim(slow)))
    factors = []
    for i in range(rope_dims // 2):
        ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        factors.append(1.0 / (freq_scale * (1.0 - ramp) + ramp))
    mscale = m.num("rope.scaling.attn_factor", float, 1.0) * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    return tuple(factors), mscale


def global_layers(m: Metadata, fam: Family, n_layer: int) -> list[bool]:
    """Which layers attend to the whole causal past (the rest use the sliding window):
    llama.cpp's set_swa_pattern(period), layer i sliding iff i % period < period - 1, or
    the file's per-layer array of "is sliding" flags (Gemma 4)."""
    if fam.sliding is None:
        return [True] * n_layer
    flags = m.flags("attention.sliding_window_pattern", n_layer, "an integer or ")
    if flags is not None:
        return [not f for f in flags]
    period = m.num("attention.sliding_window_pattern", int, fam.sliding.period, positive=False)
    if period < 0:
        raise GGUFError(f"{m.path}: metadata {m.key('attention.sliding_window_pattern')!r} "
                        f"must be >= 0, found {period}")
    return [period > 0 and i % period == period - 1 for i in range(n_layer)]


def heads(m: Metadata, n_embd: int, n_layer: int, is_global: list[bool]) -> dict:
    """Per layer: KV-head count, head size and rope dims (the sliding layers' from the
    ``*_swa`` keys where the file has them), each positive and consistent with n_head."""
    n_head = m.num("attention.head_count", int)
    kv = m.per_layer("attention.head_count_kv", n_layer, n_head)
    for n in kv:
        if n_head % n:
            raise GGUFError(f"{m.path}: attention.head_count_kv = {n} does not divide "
                            f"attention.head_count = {n_head}")
    full = m.num("attention.key_length", int, max(n_embd // n_head, 1))
    swa = m.num("attention.key_length_swa", int, full)
    for kind, size in (("", full), ("_swa", swa)):
        if m.num(f"attention.value_length{kind}", int, size) != size:
            raise GGUFError(f"{m.path}: attention.value_length{kind} differs from "
                            f"attention.key_length{kind} (not supported)")
    rope_full = m.num("rope.dimension_count", int, full)
    rope_swa = m.num("rope.dimension_count_swa", int, swa if m.raw("attention.key_length_swa")
                     else min(rope_full, swa))
    for kind, dims, size in (("", rope_full, full), ("_swa", rope_swa, swa)):
        if dims > size or dims % 2:
            raise GGUFError(f"{m.path}: rope.dimension_count{kind} = {dims} must be even and at "
                            f"most the head size {size}")
    return dict(n_head=n_head, kv=kv, head=tuple(full if g else swa for g in is_global),
                rope=tuple(rope_full if g else rope_swa for g in is_global))


def kv_sources(m: Metadata, fam: Family, n_layer: int, is_global: list[bool]) -> list[int]:
    """The layer whose keys and values each layer attends with: itself, or (the last
    ``attention.shared_kv_layers`` layers) the last earlier unshared layer of its kind."""
    shared = m.num("attention.shared_kv_layers", int, 0, positive=False) if fam.kv_sharing else 0
    if not 0 <= shared < n_layer:
        raise GGUFError(f"{m.path}: metadata {m.key('attention.shared_kv_layers')!r} = {shared} "
                        f"must be in [0, {n_layer})")
    first = n_layer - shared
    sources = []
    for i in range(n_layer):
        own = [j for j in range(first) if is_global[j] == is_global[i]]
        if i >= first and not own:
            raise GGUFError(f"{m.path}: layer {i} shares the K/V of an earlier "
                            f"{'global' if is_global[i] else 'sliding'} layer, and there is none")
        sources.append(i if i < first else own[-1])
    return sources


def experts(m: Metadata, proto: Experts, n_layer: int) -> tuple[Experts, int]:
    """(the layers' mixture of experts, the number of leading dense layers); every MoE key
    (families.MOE_KEYS) is used here or refused."""
    n_expert = m.num("expert_count", int)
    used = m.num("expert_used_count", int)
    if used > n_expert:
        raise GGUFError(f"{m.path}: {m.key('expert_used_count')} = {used} exceeds "
                        f"{m.key('expert_count')} = {n_expert}")
    shared = None
    if proto.shared is None:
        for key in ("expert_shared_count", "expert_shared_feed_forward_length"):
            if m.num(key, int, 0, positive=False):
                raise GGUFError(f"{m.path}: {m.key(key)} > 0: shared experts are not "
                                f"implemented for {m.arch}")
    else:
        if m.num("expert_shared_count", int, 1) != 1:
            raise GGUFError(f"{m.path}: {m.key('expert_shared_count')} must be 1 "
                            f"(one shared expert) for {m.arch}")
        shared = Dense(m.num("expert_shared_feed_forward_length", int), proto.activation, "_shexp")
    gating = m.num("expert_gating_func", int, 1)
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise GGUFError(f"{m.path}: {m.key('expert_gating_func')} = {gating} is not supported "
                        "(only 1, softmax)")
    norm = m.raw("expert_weights_norm")
    if norm is not None and not isinstance(norm, bool):
        raise GGUFError(f"{m.path}: metadata {m.key('expert_weights_norm')!r} must be a bool, "
                        f"found {norm!r}")
    lead = m.num("leading_dense_block_count", int, 0, positive=False)
    if not 0 <= lead < n_layer:
        raise GGUFError(f"{m.path}: {m.key('leading_dense_block_count')} = {lead} must be in "
                        f"[0, block_count = {n_layer})")
    part = Experts(count=n_expert, used=used, width=m.num("expert_feed_forward_length", int),
                   activation=proto.activation, router=proto.router,
                   norm_weights=proto.norm_weights if norm is None else norm,
                   weights_scale=m.num("expert_weights_scale", float, 1.0), bias=proto.bias,
                   shared=shared)
    return part, lead


def deltanet(m: Metadata, n_layer: int) -> tuple[list[bool], DeltaNet]:
    """Qwen3.5's recurrent layers (``attention.recurrent_layers``) and their sizes."""
    flags = m.flags("attention.recurrent_layers", n_layer, "")
    if flags is None:
        raise GGUFError(f"{m.path}: metadata {m.key('attention.recurrent_layers')!r} must be "
                        f"{n_layer} booleans, found {m.raw('attention.recurrent_layers')!r}")
    conv, k_heads = m.num("ssm.conv_kernel", int), m.num("ssm.group_count", int)
    k_dim, v_heads = m.num("ssm.state_size", int), m.num("ssm.time_step_rank", int)
    inner = m.num("ssm.inner_size", int)
    if inner % v_heads or v_heads % k_heads:
        raise GGUFError(f"{m.path}: ssm.inner_size {inner} and ssm.time_step_rank {v_heads} "
                        f"must be a multiple of the value heads and of ssm.group_count {k_heads}")
    return flags, DeltaNet(conv, k_heads, k_dim, v_heads, inner // v_heads)
