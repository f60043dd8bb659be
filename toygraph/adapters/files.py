"""LoRA adapter files: PEFT directories (Hugging Face) and llama.cpp GGUF adapters.

Adapters live in memory as ``{gguf weight name: (A, B)}`` with A [rank, n_in] and
B [n_out, rank] float32 in the GGUF row order the graph computes in (models/decoder.py);
a DoRA adapter's entries are ``(A, B, m)`` with m [n_out] its magnitude vector.
:func:`read_peft` gives the whole adapter (variants included) as a :class:`PeftAdapter`.

>>> save_peft("out/adapter", lora, cfg, rank=8, alpha=16, targets=("q", "v"),
...           base_model_name="HuggingFaceTB/SmolLM2-135M-Instruct")      # doctest: +SKIP
>>> lora, rank, alpha, targets = load_peft("out/adapter", cfg)           # doctest: +SKIP
>>> save_gguf_adapter("out/adapter.gguf", lora, cfg, alpha=16, base_arch="llama")  # doctest: +SKIP
>>> check_gguf_adapter("out/adapter.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")      # doctest: +SKIP

The one layout difference between the formats: llama-arch GGUFs store Q/K rows permuted
for llama.cpp's "normal" rope, Hugging Face checkpoints in rotate-half order (which
families do is data: Family.qk_permuted in models/families.py).
`hf_row_order` is the single place that converts (lora_B rows only: A multiplies the
hidden input, whose order both sides share). GGUF adapters keep GGUF order, since
llama.cpp adds them to the GGUF base as stored.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toygraph.atomic import atomic_write
from toygraph.bounded import excerpt, load_json, printable, regular_file_error
from toygraph.errors import DataError
from toygraph.gguf.reader import BoundedReader
from toygraph.gguf.templates import shared_name
from toygraph.adapters import experts
from toygraph.models.config import layer_shapes
from toygraph.models.decoder import ALL_TARGETS, expand_targets, lora_shapes
from toygraph.models.families import HF_LAYER_MODULES

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
#: The metadata key of the base model's record (adapters/base.py), in both formats.
BASE_METADATA = "toygraph.base"
#: safetensors metadata key recording the architecture an adapter was trained for.
ARCH_METADATA = "toygraph.arch"
#: safetensors metadata keys recording the chat template the adapter was trained with (its
#: name, and its Jinja source: toygraph/gguf/templates.py), so using it renders as training did.
TEMPLATE_NAME, TEMPLATE_SOURCE = "toygraph.template", "toygraph.chat_template"
# GGUF projection name -> Hugging Face module path inside a decoder layer (the families'
# own tables, cfg.family.hf_modules, are what export and import use; this is the default).
HF_MODULES = HF_LAYER_MODULES
_SHORT_BY_GGUF = {g: s for s, g in ALL_TARGETS.items()}
# Expert tensors an adapter may name by base tensor (llama.cpp's GGUF adapters, merges):
# the shared gate/up adapter (experts.per_base_tensor) split into its two tensors.
_BASE_ONLY = ("ffn_gate_exps", "ffn_up_exps")
_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\."
                       r"(?:lora_([AB])\.weight|lora_(magnitude)_vector)")
_PEFT_EXPERT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\."
                              r"((?:base_layer\.)*)lora_([AB])\.weight")


# --- the one layout conversion ------------------------------------------------------------
def hf_row_order(rows: np.ndarray, cfg, name: str, to_hf: bool) -> np.ndarray:
    """Rows of a q/k output (a weight, or a lora_B) between GGUF and Hugging Face order.

    transformers un-permutes llama Q/K at GGUF load with
    ``w.reshape(n_head, head_dim // 2, 2, n).swapaxes(1, 2)``; ``to_hf`` applies exactly
    that, ``to_hf=False`` its inverse. Everything else (v, o, mlp, and every family whose
    GGUFs store Q/K unpermuted: Family.qk_permuted False) passes through unchanged.
    """
    proj = name.split(".")[-2]
    order = value_head_order(cfg, proj, rows.shape[0]) if proj != "ssm_out" else None
    if order is not None:  # Qwen3.5's DeltaNet value heads (A's columns: hf_column_order)
        return np.ascontiguousarray(rows[order] if to_hf else rows[np.argsort(order)])
    if not cfg.family.qk_permuted or proj not in ("attn_q", "attn_k"):
        return rows
    attn = cfg.layers[int(name.split(".")[1])].attention   # name: blk.<i>.attn_q.weight
    n_head = attn.heads if proj == "attn_q" else attn.kv_heads
    half = rows.shape[0] // n_head // 2
    split = (n_head, half, 2) if to_hf else (n_head, 2, half)
    return np.ascontiguousarray(rows.reshape(*split, *rows.shape[1:]).swapaxes(1, 2)
                                .reshape(rows.shape))


def value_head_order(cfg, proj: str, n: int) -> np.ndarray | None:
    """Where each Hugging Face row (or ssm_out column) of a Qwen3.5 DeltaNet projection is
    in the GGUF: llama.cpp's converter stores the value heads "tiled" (head j * nk + g is
    Hugging Face's g * r + j, r = nv / nk). None when nothing moves (nk == nv, other
    projections)."""
    s = cfg.ssm
    if s is None or s.v_heads == s.k_heads or proj not in (
            "attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"):
        return None
    unit = 1 if proj in ("ssm_alpha", "ssm_beta") else s.v_dim
    r, nk = s.v_heads // s.k_heads, s.k_heads
    heads = np.array([j * nk + g for g in range(nk) for j in range(r)])   # gguf head of hf head
    order = (heads[:, None] * unit + np.arange(unit)).reshape(-1)
    skip = n - len(order)                      # attn_qkv: q and k rows stay where they are
    return np.concatenate([np.arange(skip), skip + order])


def hf_column_order(cols: np.ndarray, cfg, name: str, to_hf: bool) -> np.ndarray:
    """Columns of an ssm_out input side (a lora_A) between GGUF and Hugging Face order."""
    proj = name.split(".")[-2]
    order = value_head_order(cfg, proj, cols.shape[1]) if proj == "ssm_out" else None
    if order is None:
        return cols
    return np.ascontiguousarray(cols[:, order] if to_hf else cols[:, np.argsort(order)])


# --- shared checks -------------------------------------------------------------------------
def _targets_of(names) -> tuple[str, ...]:
    """Short target names (q, v, ...) of GGUF weight names, in ALL_TARGETS order."""
    present = {n.split(".")[-2] for n in names}
    return tuple(s for s, g in ALL_TARGETS.items() if g in present)


def _check_lora(lora: dict, cfg, where: str) -> int:
    """Validate names and shapes against ``cfg``; return the common rank."""
    if not lora:
        raise DataError(f"{where}: no adapter tensors")
    ranks = set()
    dora = {len(pair) == 3 for pair in lora.values()}
    if len(dora) != 1:
        raise DataError(f"{where}: some adapters have a DoRA magnitude vector and some do not")
    for name, (a, b, *mag) in lora.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        known = m and (m.group(2) in _SHORT_BY_GGUF or m.group(2) in _BASE_ONLY)
        if not known or int(m.group(1)) >= cfg.n_layer or (
                experts.is_expert(name) or m.group(2) in _BASE_ONLY) and not cfg.n_expert:
            raise DataError(f"{where}: {name!r} is not a LoRA-targetable weight of this "
                            f"{cfg.n_layer}-layer model")
        want_a, want_b = lora_shapes(cfg, name, a.shape[-2] if a.ndim >= 2 else 0)
        if a.ndim != len(want_a) or b.ndim != len(want_b) or a.shape[:-2] != want_a[:-2] \
                or a.shape[-1] != want_a[-1] or b.shape[:-1] != want_b[:-1]:
            rows = ", ".join(str(d) for d in want_a[:-2])
            e = rows + ", " if rows else ""
            raise DataError(f"{where}: {name!r} adapter shapes A {a.shape}, B {b.shape} do not "
                            f"fit the weight (want A [{e}r, {want_a[-1]}], "
                            f"B [{e}{want_b[-2]}, r])")
        if a.shape[-2] != b.shape[-1]:
            raise DataError(f"{where}: {name!r} rank mismatch: A has {a.shape[-2]} rows, "
                            f"B has {b.shape[-1]} columns")
        if mag and mag[0].shape != (want_b[-2],):
            raise DataError(f"{where}: {name!r} DoRA magnitude has shape {mag[0].shape}; "
                            f"the weight has {want_b[-2]} output rows")
        if not all(np.all(np.isfinite(x)) for x in (a, b, *mag)):
            raise DataError(f"{where}: {name!r} holds NaN or inf")
        ranks.add(a.shape[-2])
    if len(ranks) != 1:
        raise DataError(f"{where}: adapters have different ranks {sorted(ranks)}")
    return ranks.pop()


# --- PEFT ----------------------------------------------------------------------------------
def save_peft(dir, lora: dict, cfg, rank: int, alpha: float, targets, base_model_name: str = "",
              template: tuple[str, str] | None = None, rslora: bool = False,
              lora_dropout: float = 0.0, base: dict | None = None) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` as PEFT saves them for
    the Hugging Face model of ``cfg.arch`` (q/k lora_B rows converted to HF order).
    ``rslora``: the scale is alpha / sqrt(rank) (use_rslora); ``(A, B, m)`` entries make a
    DoRA adapter (use_dora, m saved as ``lora_magnitude_vector``, rows in HF order);
    ``lora_dropout`` is recorded as PEFT names it (it acts in training only).
    ``template``: (name, Jinja source) of the chat template the adapter was trained with,
    kept in the weights' metadata (:func:`adapter_template` reads it back); so is ``base``,
    the record of the base model (adapters/base.py base_record)."""
    dir = Path(dir)
    found = _check_lora(lora, cfg, str(dir))
    if found != rank:
        raise DataError(f"{dir}: adapters have rank {found}, but rank={rank} was given")
    targets = expand_targets(targets)
    stray = sorted(set(_targets_of(lora)) - set(targets))
    if stray or any(t not in ALL_TARGETS for t in targets):
        raise DataError(f"{dir}: targets {list(targets)} must be known names covering every "
                        f"adapter (uncovered: {stray})")
    tensors = {}
    dora = False
    params = [p for p in experts.HF_EXPERT_PARAMS if any(f".{p}." in n for n in lora)]
    for name, (a, b, *mag) in lora.items():
        layer, proj = int(name.split(".")[1]), name.split(".")[2]
        if experts.is_expert(name):   # target_parameters (adapters/experts.py)
            key = experts.peft_keys(layer, params)[proj]
            tensors[f"{key}lora_A.weight"], tensors[f"{key}lora_B.weight"] = \
                experts.to_peft(name, a, b, cfg)
            continue
        key = f"base_model.model.model.layers.{layer}.{cfg.family.hf_modules[proj]}"
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(
            hf_column_order(np.asarray(a, np.float32), cfg, name, to_hf=True))
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(
            hf_row_order(np.asarray(b, np.float32), cfg, name, to_hf=True))
        if mag:
            dora = True
            tensors[f"{key}.lora_magnitude_vector"] = np.ascontiguousarray(
                hf_row_order(np.asarray(mag[0], np.float32), cfg, name, to_hf=True))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name or None, "revision": None,
        "r": int(rank), "lora_alpha": float(alpha), "lora_dropout": float(lora_dropout),
        "target_modules": sorted(cfg.family.hf_modules[ALL_TARGETS[t]].split(".")[1] for t in targets
                                 if ALL_TARGETS[t] not in experts.HF_EXPERT_PARAMS),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": bool(rslora), "use_dora": dora,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }
    if params:   # PEFT's adapters of the experts' 3-D parameters, in the order keyed above
        config["target_parameters"] = [experts.HF_EXPERT_PARAMS[p] for p in params]
    dir.mkdir(parents=True, exist_ok=True)
    # Each file is replaced whole; the config goes last, so a crash in between leaves the
    # old config with complete (new) weights, never a truncated file.
    # The architecture goes into the safetensors metadata (PEFT ignores it there, while an
    # unknown adapter_config key makes PEFT warn): q/k rows are stored in HF order, which
    # differs between architectures, so an adapter must not load onto another one.
    metadata = {"format": "pt", ARCH_METADATA: cfg.arch}
    if template is not None:
        metadata.update({TEMPLATE_NAME: shared_name(template[0]), TEMPLATE_SOURCE: template[1]})
    if base is not None:
        metadata[BASE_METADATA] = json.dumps(base, sort_keys=True)
    atomic_write(dir / WEIGHTS_FILE, lambda p: _save_sorted_metadata(tensors, p, metadata))
    atomic_write(dir / CONFIG_FILE,
                  lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    return dir


def _save_sorted_metadata(tensors: dict, path: str, metadata: dict):
    """safetensors' save_file, with the metadata in sorted order: it keeps metadata in a
    Rust HashMap, whose order changes from process to process, so two runs would write
    different bytes. The header is rewritten in place (same keys, same length)."""
    from safetensors.numpy import save_file
    save_file(tensors, path, metadata=metadata)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":")).encode()
        f.seek(8)
        f.write(text.ljust(n))


#: The largest scale of B A (alpha / rank, rsLoRA's alpha / sqrt(rank)) an adapter may
#: have: LoRA runs use about 0.5 to 4; far past this, training and the merge lose
#: every bit of the base to the update (and past ~1e38, f32 has no such number).
MAX_LORA_SCALE = 1024.0

#: adapter_config.json keys that do not change what the adapter computes once trained
#: (bookkeeping, training-only dropout, how it was initialised without touching the
#: base), or whose meaning the tensors carry (which modules have adapters).
PEFT_INERT_KEYS = {"task_type", "peft_type", "auto_mapping", "peft_version",
                   "base_model_name_or_path", "revision", "inference_mode", "lora_dropout",
                   "target_modules", "exclude_modules", "megatron_core", "qalora_group_size",
                   "ensure_weight_tying", "loftq_config", "eva_config", "corda_config",
                   "lora_ga_config", "runtime_config"}
#: Keys whose effect is implemented (read_peft), with the values PEFT writes for "off".
PEFT_HONOURED_KEYS = {"r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias",
                      "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                      "target_parameters", "init_lora_weights", "modules_to_save"}
#: init_lora_weights values that leave the base as it is (pissa, olora, corda, loftq and
#: lora_ga change the base weights themselves, so the adapter alone means something else).
_BASE_KEEPING_INITS = (True, False, "gaussian", "eva", "orthogonal")


def _read_peft_config(path: Path) -> dict:
    """adapter_config.json, every key that changes the math honoured or refused by name
    (an unknown key with a value set is refused: we cannot know it changes nothing)."""
    if not path.exists():   # anything else but a regular file is refused by load_json
        raise DataError(f"{path}: missing PEFT adapter config")
    config = load_json(path, max_bytes=1 << 20, allow_nan=True)   # NaN: named by its key below
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object, found {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise DataError(f"{path}: peft_type is {excerpt(config.get('peft_type'))}; only 'LORA' "
                        "is supported")
    for key, value in config.items():
        if key not in PEFT_INERT_KEYS | PEFT_HONOURED_KEYS and value not in (None, False, [], {}):
            raise DataError(f"{path}: {excerpt(key)} = {excerpt(value)} is not a setting "
                            "toygraph implements; refused rather than ignored, as it may change "
                            "what the adapter computes")
    if config.get("fan_in_fan_out"):
        raise DataError(f"{path}: fan_in_fan_out=true is not supported")
    for key in ("use_dora", "use_rslora"):
        if not isinstance(config.get(key, False), bool):
            raise DataError(f"{path}: {key} must be true or false, found {excerpt(config[key])}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise DataError(f"{path}: {key} ({excerpt(config[key])}) is not supported: per-module "
                            "ranks and alphas, or whole modules trained beside the adapter")
    if config.get("bias", "none") != "none":
        raise DataError(f"{path}: bias={excerpt(config['bias'])} is not supported (only 'none')")
    init = config.get("init_lora_weights", True)
    if not any(init is v or (isinstance(v, str) and init == v) for v in _BASE_KEEPING_INITS):
        raise DataError(f"{path}: init_lora_weights={excerpt(init)} changed the base model's "
                        "weights as well as initialising the adapter; convert it to a plain "
                        "LoRA adapter (PEFT's path_initial_model_for_weight_conversion)")
    rank, alpha = config.get("r"), _positive_number(config.get("lora_alpha"))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= 1 << 16:
        raise DataError(f"{path}: r must be a whole number in 1..65536, found {excerpt(rank)}")
    if alpha is None:
        raise DataError(f"{path}: lora_alpha must be a finite number > 0, found "
                        f"{excerpt(config.get('lora_alpha'))}")
    scale = lora_scale(alpha, rank, bool(config.get("use_rslora", False)))
    if scale > MAX_LORA_SCALE:
        raise DataError(f"{path}: lora_alpha {alpha:g} with r={rank} scales the update by "
                        f"{scale:.4g}, above {MAX_LORA_SCALE:g} (LoRA uses about 0.5 to 4): a "
                        "damaged or mistyped config")
    _layers_to_transform(config, path)   # checked here, applied by read_peft
    return config


def _positive_number(v) -> float | None:
    """``v`` as a finite float > 0, else None (bools, text, NaN, inf, 10**400 alike)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) and f > 0 else None


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """The scale of B A: alpha / rank, rsLoRA's alpha / sqrt(rank)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def _layers_to_transform(config: dict, path: Path) -> frozenset[int] | None:
    """PEFT's layers_to_transform as the layer numbers that may hold adapters (None: all).
    layers_pattern only names the module list those numbers index, which for the decoders
    toygraph reads is "layers" (model.model.layers)."""
    layers = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if pattern not in (None, "layers", ["layers"]):
        raise DataError(f"{path}: layers_pattern {excerpt(pattern)} is not this model's layer "
                        "list ('layers')")
    if layers is None:
        return None
    layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(layers, list) or not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        raise DataError(f"{path}: layers_to_transform must be a layer number or a list of them, "
                        f"found {excerpt(config['layers_to_transform'])}")
    return frozenset(layers)


def _expert_params(config: dict, path: Path) -> dict[int, str]:
    """PEFT's target_parameters as {nesting depth of its keys: GGUF projection}
    (adapters/experts.py: the nesting follows the experts module's parameter order, not
    the order the config lists them in, which PEFT saves from a set)."""
    names = config.get("target_parameters") or []
    by_hf = {hf: g for g, hf in experts.HF_EXPERT_PARAMS.items()}
    if not isinstance(names, list) or any(n not in by_hf for n in names) \
            or len(set(names)) != len(names):
        raise DataError(f"{path}: target_parameters {names!r} must name distinct parameters "
                        f"among {sorted(by_hf)}")
    procs = [g for g, hf in experts.HF_EXPERT_PARAMS.items() if hf in names]
    return {len(procs) - 1 - i: g for i, g in enumerate(procs)}


def adapter_template(dir) -> tuple[str, str] | None:
    """(name, Jinja source) of the chat template a PEFT adapter directory was trained with,
    None when it records none (an adapter of another tool, or of toygraph 0.1)."""
    from safetensors import SafetensorError, safe_open
    path = Path(dir) / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError):
        return None   # load_peft reports what is wrong with the file
    if TEMPLATE_NAME in meta and TEMPLATE_SOURCE in meta:   # the name is shown: escaped
        return printable(meta[TEMPLATE_NAME])[:200], meta[TEMPLATE_SOURCE]
    return None


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter as toygraph uses it: ``lora`` in GGUF layout ((A, B), or
    (A, B, m) for DoRA), its rank, alpha, short target names and variant flags."""
    lora: dict
    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    dora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def load_peft(dir, cfg) -> tuple[dict, int, float, tuple[str, ...]]:
    """(lora, rank, alpha, targets) of a plain PEFT LoRA directory (:func:`read_peft`);
    an adapter with rsLoRA or DoRA is refused here, as these four values do not describe it."""
    a = read_peft(dir, cfg)
    if a.rslora or a.dora:
        raise DataError(f"{dir}: {'a DoRA' if a.dora else 'an rsLoRA'} adapter; this use "
                        "takes plain LoRA adapters only")
    return a.lora, a.rank, a.alpha, a.targets


def read_peft(dir, cfg) -> PeftAdapter:
    """Read a PEFT LoRA directory for the model ``cfg`` (use_rslora and use_dora included).
    Raises DataError naming the file for anything it cannot use."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    dir = Path(dir)
    if not dir.is_dir():   # e.g. a checkpoint pruned since: say so, not "missing config"
        raise DataError(f"{dir}: no such adapter directory")
    config = _read_peft_config(dir / CONFIG_FILE)
    wpath = dir / WEIGHTS_FILE
    if not wpath.exists():
        raise DataError(f"{wpath}: missing adapter weights (only safetensors is supported)")
    if regular_file_error(wpath):   # a FIFO or a device: never opened
        raise DataError(f"{wpath}: {regular_file_error(wpath)}")
    try:
        raw = load_file(str(wpath))
        with safe_open(str(wpath), "np") as f:
            arch = (f.metadata() or {}).get(ARCH_METADATA)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise DataError(f"{wpath}: cannot read safetensors ({e})") from None
    if arch is not None and arch != cfg.arch:
        raise DataError(f"{wpath}: adapter was trained on a {printable(arch)[:80]} model; the base model is "
                        f"{cfg.arch} (q/k row order and semantics differ)")
    for key, value in raw.items():
        if value.dtype.kind != "f":
            raise DataError(f"{wpath}: tensor {key!r} is {value.dtype}; adapter tensors must be "
                            f"floating point")
    halves: dict[str, dict[str, np.ndarray]] = {}
    gguf_by_hf = {hf: g for g, hf in cfg.family.hf_modules.items()}
    nested = _expert_params(config, dir / CONFIG_FILE)   # "base_layer." depth -> projection
    layers = _layers_to_transform(config, dir / CONFIG_FILE)  # the others keep B = 0: no update
    for key, value in raw.items():
        m = _PEFT_KEY.fullmatch(key)
        proj = gguf_by_hf.get(m.group(2)) if m else None
        e = _PEFT_EXPERT_KEY.fullmatch(key)
        if e and cfg.n_expert:
            m, proj = e, nested.get(len(e.group(2)) // len("base_layer."))
        if proj is None or int(m.group(1)) >= cfg.n_layer:
            raise DataError(f"{wpath}: key {excerpt(key)} does not map to a LoRA module of this "
                            f"{cfg.n_layer}-layer {cfg.arch} model")
        if layers is not None and int(m.group(1)) not in layers:   # PEFT would not load it
            raise DataError(f"{wpath}: key {excerpt(key)} is in layer {int(m.group(1))}, which "
                            f"layers_to_transform {sorted(layers)} in {CONFIG_FILE} leaves out")
        halves.setdefault(f"blk.{int(m.group(1))}.{proj}.weight", {})[m.group(3) or "m"] = value
    dora = bool(config.get("use_dora", False))
    want = {"A", "B", "m"} if dora else {"A", "B"}
    lora = {}
    for name, pair in halves.items():
        if set(pair) != want:
            raise DataError(f"{wpath}: {name!r} has {sorted(pair)} of {sorted(want)} "
                            f"(use_dora={str(dora).lower()} in {CONFIG_FILE})")
        lora[name] = tuple(pair[k].astype(np.float32) for k in sorted(want))
    lora = {n: experts.from_peft(n, *pair, cfg, str(wpath)) if experts.is_expert(n) else pair
            for n, pair in lora.items()}
    rank = _check_lora(lora, cfg, str(wpath))  # shapes checked before any reshape below
    if rank != config["r"]:
        raise DataError(f"{wpath}: tensors have rank {rank} but {CONFIG_FILE} says r={config['r']}")
    lora = {n: (hf_column_order(a, cfg, n, to_hf=False), hf_row_order(b, cfg, n, to_hf=False),
                *(hf_row_order(x, cfg, n, to_hf=False) for x in mag))
            for n, (a, b, *mag) in lora.items()}
    return PeftAdapter(lora, rank, float(config["lora_alpha"]), _targets_of(lora),
                       rslora=bool(config.get("use_rslora", False)), dora=dora)


# --- llama.cpp GGUF adapters ---------------------------------------------------------------
def save_gguf_adapter(path, lora: dict, cfg, alpha: float, base_arch: str,
                      rslora: bool = False, base: dict | None = None) -> Path:
    """Write a llama.cpp LoRA adapter GGUF (f32, rows in GGUF order).

    numpy shapes A [r, n_in] and B [n_out, r] are ggml shapes [n_in, r] and [r, n_out],
    which is what llama.cpp's loader checks against the base tensor. llama.cpp scales by
    adapter.lora.alpha / rank, so an rsLoRA adapter (alpha / sqrt(rank)) is written with
    alpha * sqrt(rank). llama.cpp has no DoRA: a DoRA adapter is refused. Expert adapters
    are written per expert tensor, 3-D (adapters/experts.py). ``base``: the record of the
    base model (adapters/base.py), written as the string key ``toygraph.base``.
    """
    import gguf

    path = Path(path)
    rank = _check_lora(lora, cfg, str(path))
    lora = experts.per_base_tensor(lora)   # llama.cpp has no shared gate/up expert tensor
    if any(len(pair) == 3 for pair in lora.values()):
        raise DataError(f"{path}: llama.cpp's LoRA adapters have no DoRA; export the merged "
                        "model instead (toygraph export)")
    if rslora:
        alpha = alpha * math.sqrt(rank)

    def write(tmp):
        w = gguf.GGUFWriter(tmp, base_arch)
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(alpha))
        if base is not None:
            w.add_string(BASE_METADATA, json.dumps(base, sort_keys=True))
        for name, (a, b) in lora.items():
            w.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, np.float32))
            w.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)
    return path


def _open_reader(path: Path, what: str = "GGUF adapter file"):
    """The bounded reader of ``path`` (gguf-py's own trusts every count it reads)."""
    if not path.is_file():
        raise DataError(f"{path}: no such {what}")
    try:
        return BoundedReader(str(path), "r")
    except Exception as e:  # the reader raises GGUFError, ValueError, KeyError, ... on a bad file
        raise DataError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key):
    f = reader.get_field(key)
    if f is None:
        return None
    v = f.contents()
    return v.item() if isinstance(v, np.generic) else v


def _validate_gguf_adapter(reader, path: Path, arch: str, base_ne: dict) -> tuple[dict, int, float]:
    """llama.cpp's llama_adapter_lora_init rules. ``base_ne`` maps base tensor names to
    ggml shapes (ne[0] = row length). Returns ({name: (a tensor, b tensor)}, rank, alpha)."""
    got = _field(reader, "general.architecture")
    if got != arch:
        raise DataError(f"{path}: adapter architecture {got!r} does not match the base model's {arch!r}")
    if _field(reader, "general.type") != "adapter":
        raise DataError(f"{path}: general.type is {_field(reader, 'general.type')!r}, expected 'adapter'")
    if _field(reader, "adapter.type") != "lora":
        raise DataError(f"{path}: adapter.type is {_field(reader, 'adapter.type')!r}, expected 'lora'")
    alpha = _field(reader, "adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise DataError(f"{path}: adapter.lora.alpha is missing (or not a number)")
    pairs: dict[str, dict] = {}
    for t in reader.tensors:
        base, dot, half = t.name.rpartition(".")
        if not dot or half not in ("lora_a", "lora_b"):
            raise DataError(f"{path}: tensor {t.name!r} is not a .lora_a/.lora_b tensor")
        pairs.setdefault(base, {})[half] = t
    if not pairs:
        raise DataError(f"{path}: the adapter holds no tensors")
    ranks = set()
    for base, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise DataError(f"{path}: LoRA tensor pair for {base!r} is missing one component")
        if base not in base_ne:
            raise DataError(f"{path}: LoRA tensor {base!r} does not exist in the base model")
        ne = base_ne[base]
        a, b = (tuple(int(d) for d in pair[h].shape) for h in ("lora_a", "lora_b"))
        # an expert stack (ne [n_in, n_out, E]): llama.cpp's build_lora_mm_id takes
        # lora_a [n_in, r, E] and lora_b [r, n_out, E]
        if len(a) != len(ne) or len(b) != len(ne) or a[0] != ne[0] or b[1] != ne[1] \
                or a[2:] != tuple(ne[2:]) or b[2:] != tuple(ne[2:]):
            raise DataError(f"{path}: {base!r} has lora_a ne={a}, lora_b ne={b}; the base tensor "
                            f"is ne={tuple(ne)}, so want a=[{ne[0]}, r{_tail(ne)}], "
                            f"b=[r, {ne[1]}{_tail(ne)}] "
                            "(wrong base model, or a/b transposed?)")
        if a[1] != b[0]:
            raise DataError(f"{path}: {base!r} rank mismatch: lora_a has r={a[1]}, lora_b r={b[0]}")
        ranks.add(a[1])
    if len(ranks) != 1:
        raise DataError(f"{path}: adapters have different ranks {sorted(ranks)}")
    rank = ranks.pop()
    # llama.cpp: an alpha of 0 means none, a scale of 1 (alpha = rank)
    alpha = float(alpha) if alpha else float(rank)
    if not math.isfinite(alpha) or abs(alpha) / rank > MAX_LORA_SCALE:
        raise DataError(f"{path}: adapter.lora.alpha {alpha:g} with rank {rank} scales the update "
                        f"by {alpha / rank:.4g}, beyond {MAX_LORA_SCALE:g} (LoRA uses about 0.5 "
                        "to 4): a damaged file")
    return {k: (p["lora_a"], p["lora_b"]) for k, p in pairs.items()}, rank, alpha


def _tail(ne) -> str:
    return "".join(f", {d}" for d in ne[2:])


def check_gguf_adapter(adapter_path, base_gguf_path) -> dict:
    """Check an adapter against its base GGUF as llama.cpp's loader does; DataError with
    the reason if llama.cpp would refuse it. Returns {"rank", "alpha", "tensors"}."""
    adapter_path, base_path = Path(adapter_path), Path(base_gguf_path)
    base = _open_reader(base_path, "base GGUF")
    base_ne = {t.name: tuple(int(d) for d in t.shape) for t in base.tensors}
    pairs, rank, alpha = _validate_gguf_adapter(
        _open_reader(adapter_path), adapter_path, _field(base, "general.architecture"), base_ne)
    return {"rank": rank, "alpha": alpha, "tensors": sorted(pairs)}


def load_gguf_adapter(path, cfg) -> tuple[dict, int, float, tuple[str, ...]]:
    """Read a GGUF LoRA adapter for ``cfg``: (lora in GGUF layout, rank, alpha, targets)."""
    import gguf

    path = Path(path)
    reader = _open_reader(path)
    base_ne = {}
    for i in range(cfg.n_layer):
        shapes = layer_shapes(cfg, i)
        for proj in (*cfg.family.hf_modules, "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            name = f"blk.{i}.{proj}.weight"
            if name in shapes:   # the projections this layer has
                base_ne[name] = tuple(reversed(shapes[name]))
    pairs, rank, alpha = _validate_gguf_adapter(reader, path, cfg.arch, base_ne)
    lora = {}
    for name, (a, b) in pairs.items():
        for t in (a, b):
            if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                raise DataError(f"{path}: {t.name!r} is {t.tensor_type.name}; only F32/F16 "
                                "adapter tensors are supported")
        # t.data is numpy-order (ggml shape reversed); copy out of the memmap.
        lora[name] = tuple(np.array(t.data, np.float32).reshape(tuple(reversed(t.shape.tolist())))
                           for t in (a, b))
    _check_lora(lora, cfg, str(path))
    return lora, rank, alpha, _targets_of(lora)


def load_lora(sess, net, lora: dict) -> None:
    """Load adapter weights ``lora`` (GGUF weight name -> (A, B) or (A, B, m), as
    read_peft gives them) into the LoRA params of ``net`` (a Decoder in a realized session:
    its ``lora`` pairs and, for DoRA, its ``magnitudes``). A layer the adapter lacks keeps
    B = 0 (and DoRA's m its initial row norms of W): no change to the base model."""
    for name, (a, b) in net.lora.items():
        if name in lora:
            sess.load_param(a, lora[name][0])
            sess.load_param(b, lora[name][1])
            if name in net.magnitudes:
                sess.load_param(net.magnitudes[name], lora[name][2])
