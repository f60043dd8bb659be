"""The options of a fine-tuning run, each checked up front with a one-line error.

``TrainConfig.validate`` checks every option on its own (ranges, finiteness, types);
``check_against_model`` checks those that depend on the model (context length, LoRA rank
against the widths of the targeted matrices). Errors name the CLI flag.

Every default is written once, in the lowest layer that uses it: the LoRA shape, seed and
init scale in ``LoraConfig`` (models/decoder.py), the step shape, clip, precision and
backend in ``RecipeOptions`` (recipes/base.py); ``TrainConfig`` reads them from there and
the CLI reads its defaults from ``TrainConfig`` (tests/test_names.py checks the chain).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from toygraph.core.precision import BACKENDS, precision_error
from toygraph.errors import ToygraphError
from toygraph.models.decoder import LoraConfig as _Lora
from toygraph.recipes import RecipeOptions as _Recipe
from toygraph.recipes import dpo as _dpo

RECIPES = ("lora", "full", "scratch", "dpo", "orpo")
#: The recipes that train LoRA adapters on a frozen base (the rest train every weight).
ADAPTER_RECIPES = ("lora", "dpo", "orpo")
#: The preference-tuning recipes: their data are chosen/rejected pairs (toygraph.data.preference).
PREFERENCE_RECIPES = ("dpo", "orpo")


@dataclass
class TrainConfig:
    model: str
    data: str
    out: str
    recipe: str = "lora"
    targets: tuple[str, ...] = _Lora.targets
    rank: int = _Lora.rank
    alpha: float = _Lora.alpha
    beta: float = _dpo.BETA        # dpo/orpo: DPO's KL strength, ORPO's odds-ratio weight
    label_smoothing: float = _dpo.LABEL_SMOOTHING  # dpo: assumed chance a pair is flipped
    steps: int | None = None
    epochs: float | None = None
    batch: int = _Recipe.batch
    grad_accum: int = _Recipe.grad_accum
    seq_len: int = _Recipe.seq_len
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup: int = 0
    min_lr: float = 0.0
    clip: float = _Recipe.clip
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    seed: int = _Recipe.seed
    init_scale: float = _Recipe.init_scale
    val_split: float = 0.1
    eval_every: int = 0            # 0: at the end of every epoch and at the last step
    patience: int = 0              # early stopping after this many evals without gain; 0 off
    save_every: int = 0            # checkpoints every N steps; 0 off (time and evals still save)
    save_minutes: float = 5.0      # checkpoints every N minutes of training; 0 off
    keep_checkpoints: int = 3      # step checkpoints kept (best/ is kept apart)
    diverge_factor: float = 10.0   # stop when a loss exceeds this x the running median; 0 off
    adapter_init: str | None = None
    resume: str | None = None
    overwrite: bool = False        # replace the run in ``out``
    allow_change: tuple[str, ...] = ()   # options that may differ from the resumed checkpoint
    backend: str = _Recipe.backend
    precision: str = _Recipe.precision   # matmul input precision (toygraph.core.precision.PRECISIONS)
    checkpoint_activations: bool = _Recipe.checkpoint_activations   # recompute blocks in the backward
    pack: bool = _Recipe.pack            # sample packing: several examples per row (packing.py)
    max_examples: int | None = None
    quiet: bool = False
    extra: dict = field(default_factory=dict)

    def options(self) -> dict:
        """Every option as plain JSON (what a checkpoint records)."""
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(self).items() if k != "extra"}

    def validate(self):
        """Raise ToygraphError naming the flag of the first option out of range."""
        if self.steps is not None and self.epochs is not None:
            raise ToygraphError("give --steps or --epochs, not both")
        _choice("recipe", self.recipe, RECIPES)
        _choice("schedule", self.schedule, ("constant", "cosine", "linear"))
        _choice("backend", self.backend, BACKENDS)
        why = precision_error(self.precision, self.backend)
        if why:
            raise ToygraphError(f"--precision {why}")
        for name in ("batch", "grad_accum", "seq_len", "rank", "keep_checkpoints"):
            _integer(name, getattr(self, name), lo=1)
        for name in ("warmup", "seed", "eval_every", "patience", "save_every"):
            _integer(name, getattr(self, name), lo=0)
        if self.steps is not None:
            _integer("steps", self.steps, lo=1)
        if self.max_examples is not None:
            _integer("max_examples", self.max_examples, lo=1)
        if self.epochs is not None:
            _real("epochs", self.epochs, lo=0, open_lo=True)
        for name in ("alpha", "lr", "eps", "beta"):
            _real(name, getattr(self, name), lo=0, open_lo=True)
        for name in ("min_lr", "clip", "weight_decay", "init_scale", "save_minutes", "diverge_factor"):
            _real(name, getattr(self, name), lo=0)
        for name in ("beta1", "beta2", "val_split"):
            _real(name, getattr(self, name), lo=0, hi=1)
        _real("label_smoothing", self.label_smoothing, lo=0, hi=0.5)
        if self.label_smoothing and self.recipe != "dpo":
            raise ToygraphError("--label-smoothing needs --recipe dpo")
        if self.min_lr > self.lr:
            raise ToygraphError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if 0 < self.diverge_factor <= 1:
            raise ToygraphError(f"--diverge-factor must be > 1 (0 = off), got {self.diverge_factor}")
        if self.patience and not self.val_split:
            raise ToygraphError("--patience needs a validation set (--val-split > 0)")
        if self.recipe not in ADAPTER_RECIPES and self.adapter_init:
            raise ToygraphError(f"--adapter-init needs --recipe {', '.join(ADAPTER_RECIPES)}")
        if self.overwrite and self.resume:
            raise ToygraphError("give --resume or --overwrite, not both")
        if not self.out or not str(self.out).strip():
            raise ToygraphError("--out must name a directory, got an empty string")
        unknown = sorted(set(self.allow_change) - {f.name for f in fields(self)})
        if unknown:
            raise ToygraphError(f"--allow-change: no options named {unknown}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(name, value, allowed):
    if value not in allowed:
        raise ToygraphError(f"{_flag(name)} must be one of {', '.join(allowed)}, got {value!r}")


def _integer(name, value, lo: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ToygraphError(f"{_flag(name)} must be an integer >= {lo}, got {value!r}")


def _real(name, value, lo: float, hi: float | None = None, open_lo: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if open_lo else value >= lo) and (hi is None or value < hi)
    if not ok:
        rng = f"{'>' if open_lo else '>='} {lo}" + (f" and < {hi}" if hi is not None else "")
        raise ToygraphError(f"{_flag(name)} must be a finite number {rng}, got {value!r}")


def check_against_model(train_cfg: TrainConfig, model_cfg) -> None:
    """Options that depend on the model: context length and LoRA rank vs matrix widths."""
    if train_cfg.seq_len > model_cfg.n_ctx:
        raise ToygraphError(f"--seq-len {train_cfg.seq_len} exceeds the model's context length "
                            f"{model_cfg.n_ctx}")
    if train_cfg.recipe not in ADAPTER_RECIPES:
        return
    _Lora(targets=tuple(train_cfg.targets), rank=train_cfg.rank, alpha=train_cfg.alpha)  # names checked
    d, ff = model_cfg.n_embd, model_cfg.n_ff
    q, kv = model_cfg.n_head * model_cfg.head_dim, model_cfg.n_head_kv * model_cfg.head_dim
    widths = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d),
              "gate": (d, ff), "up": (d, ff), "down": (ff, d)}
    for t in (t for t in train_cfg.targets if t in widths):
        limit = min(widths[t])
        if train_cfg.rank > limit:
            raise ToygraphError(f"--rank {train_cfg.rank} exceeds the {t} matrix's smaller side "
                                f"{limit} (a rank above it adds nothing); use --rank <= {limit}")
