"""The options of a fine-tuning run, declared once: ``RunConfig``.

Every field carries its type, its default, a help text, how a resumed run treats it and
its bounds (``option``, recipes/options.py). The fields declared here every run takes;
each recipe declares the ones only it takes beside its class (its ``Options``: GRPO's in
recipes/grpo.py, the LoRA variants in recipes/lora.py), and RunConfig inherits them all,
so a recipe uses exactly its ``Options``' fields. Everything else comes from here: the ``toygraph finetune`` flags (toygraph/cli/finetune.py), the YAML run file
(``--config run.yaml``; the keys are the field names), the ``run.yaml`` kept in the run
directory, which repeats the run, and the settings block printed when a run starts (all
three run_file.py), the resume-compatibility check (resume.py) and ``run_start`` in
``events.jsonl``:

>>> cfg = RunConfig(model="m.gguf", data="d.jsonl", out="runs/x", steps=50)   # doctest: +SKIP
>>> run_training(cfg)                                                         # doctest: +SKIP

Defaults are written once, in the lowest layer that uses them: the LoRA shape, seed and
init scale in ``LoraConfig`` (models/decoder.py), the step shape, clip, precision and
backend in ``RecipeOptions`` (recipes/base.py), the recipes' own beside their options;
the fields here read them from there. ``validate`` checks each option on its
own and against the others; ``check_against_model`` what depends on the model. Errors
name the flag.
"""
from __future__ import annotations

import math
import typing
from dataclasses import MISSING, asdict, dataclass, fields

from toygraph.bounded import excerpt
from toygraph.core.frozen_base import MODES as BASE_MEMORY_MODES
from toygraph.precision import BACKENDS, PRECISIONS, precision_error
from toygraph.errors import ToygraphError
from toygraph.models.catalog import model_forms
from toygraph.models.decoder import LoraConfig, expand_targets
from toygraph.recipes import RECIPES, RecipeOptions, recipe_class
from toygraph.recipes.dpo import DPOOptions
from toygraph.recipes.grpo import GRPOOptions
from toygraph.recipes.lora import LoRAOptions
from toygraph.recipes.options import GROUPS, checks_of, option  # noqa: F401 (GROUPS: the CLI's)

#: The largest float32: every float option must fit one (the step's hyperparameters are an
#: f32 tensor; --epochs times the rows is a step count).
F32_MAX = 3.4028234663852886e38


def _recipes_help() -> str:
    """The --recipe help, from the registered recipes themselves."""
    return "what trains: " + "; ".join(f"{name} ({cls.summary})" if cls.summary else name
                                       for name, cls in RECIPES.items())


@dataclass(kw_only=True)
class RunConfig(GRPOOptions, DPOOptions, LoRAOptions):
    """Every option of a fine-tuning run (see the module docstring): the ones every run
    shares, declared here, and every built-in recipe's, declared beside it (its
    ``Options``, recipes/options.py)."""

    # --- what to train ---------------------------------------------------------------------
    model: str = option(help=model_forms(), group="run", resume="free")
    # data files, mixed by weight (toygraph/data/mixing.py): one per flag
    data: list[str] = option(help="JSONL: instruction/response, alpaca, chat (tool calls too), "
                                  "ShareGPT, prompt/completion or text rows; {prompt, chosen, "
                                  "rejected} pairs for dpo/orpo. Repeat as PATH:WEIGHT to mix "
                                  "files (a.jsonl:0.7 --data b.jsonl:0.3)",
                             group="run", resume="free")
    out: str = option(help="run directory: adapter, checkpoints, events.jsonl, run.yaml",
                      group="run", resume="free")
    recipe: str = option("lora", help=_recipes_help(),
                         group="run", resume="never", choices=lambda: tuple(RECIPES))
    max_examples: int | None = option(None, help="use only the first N rows of each data file",
                                      group="run", low=1)
    template: str | None = option(None, help="chat template conversations are rendered with: "
                                             "gguf (the model's own), alpaca, chatml, or a Jinja "
                                             "file; none: the model's own, alpaca without one",
                                  group="run")
    # --- steps and batches -----------------------------------------------------------------
    steps: int | None = option(None, help="optimizer steps; none: one epoch, or what --epochs says",
                               group="steps", low=1)
    epochs: float | None = option(None, help="passes over the data instead of --steps",
                                  group="steps", low=0, open_low=True)
    batch: int = option(RecipeOptions.batch, help="sequences per step (pairs for dpo/orpo); "
                                                  "the job's batch under mpirun",
                        group="steps", low=1)
    grad_accum: int = option(RecipeOptions.grad_accum, help="micro-batches of --batch per "
                                                            "optimizer step",
                             group="steps", low=1)
    max_passes_per_step: float = option(4.0, help="refuse a step (--batch x --grad-accum) "
                                                  "longer than this many passes over the "
                                                  "training data; 0 = no limit",
                                        group="steps", low=0)
    seq_len: int = option(RecipeOptions.seq_len, help="tokens per sequence (longer examples "
                                                      "are cut)",
                          group="steps", low=1)
    seed: int = option(RecipeOptions.seed, help="seed of the data order and the adapters' init",
                       group="steps", low=0, high=2**63)
    init_scale: float = option(RecipeOptions.init_scale, help="std of the LoRA A init",
                               group="steps", low=0)
    # --- optimizer and schedule ------------------------------------------------------------
    lr: float = option(1e-3, help="peak learning rate", group="optimizer", low=0, open_low=True)
    schedule: str = option("cosine", help="learning-rate schedule after the warmup",
                           group="optimizer", choices=("constant", "cosine", "linear"))
    warmup: int = option(0, help="linear warmup steps", group="optimizer", low=0)
    min_lr: float = option(0.0, help="the schedule's floor", group="optimizer", low=0)
    clip: float = option(RecipeOptions.clip, help="global gradient-norm clip; 0 = off",
                         group="optimizer", low=0)
    weight_decay: float = option(0.0, help="AdamW's decoupled weight decay", group="optimizer",
                                 low=0)
    beta1: float = option(0.9, help="AdamW beta1", group="optimizer", low=0, high=1)
    beta2: float = option(0.999, help="AdamW beta2", group="optimizer", low=0, high=1)
    eps: float = option(1e-8, help="AdamW epsilon", group="optimizer", low=0, open_low=True)
    # --- evaluation ------------------------------------------------------------------------
    val_split: float = option(0.1, help="fraction held out for validation; 0 = none",
                              group="evaluation", low=0, high=1)
    eval_every: int = option(0, help="evaluate every N steps; 0 = every epoch and at the end",
                             group="evaluation", low=0)
    patience: int = option(0, help="stop after N evaluations without a gain; 0 = off",
                           group="evaluation", low=0)
    # --report-to (toygraph/training/reporting.py): the event log's scalars elsewhere too
    report_to: list[str] = option((), help="also log the scalars of events.jsonl to tensorboard "
                                           "(event files in RUN_DIR/tensorboard) and/or wandb "
                                           "(repeat the flag or use commas); none: neither",
                                  group="evaluation", resume="free")
    # --- checkpoints, resume and safety ----------------------------------------------------
    save_every: int = option(0, help="also checkpoint every N steps (evaluations always "
                                     "checkpoint); 0 = off",
                             group="safety", resume="free", low=0)
    save_minutes: float = option(5.0, help="checkpoint every N minutes; 0 = off",
                                 group="safety", resume="free", low=0)
    final: str | None = option(None, help="what the run directory's top level holds at the end: "
                                          "best (the lowest validation loss) or last (the last "
                                          "step); none: best when there is a validation split",
                               group="safety", resume="free", choices=("best", "last"))
    keep_checkpoints: int = option(3, help="step checkpoints kept (best/ is kept apart)",
                                   group="safety", resume="free", low=1)
    diverge_factor: float = option(10.0, help="stop as diverged when a loss exceeds this x the "
                                              "running median; 0 = off",
                                   group="safety", low=0)
    resume: str | None = option(None, help="run directory (its newest good checkpoint) or "
                                           "checkpoint to continue",
                                group="safety", resume="free", file=False)
    overwrite: bool = option(False, help="replace the run already in --out", group="safety",
                             resume="free", file=False)
    allow_change: tuple[str, ...] = option((), help="options that may differ from the resumed "
                                                    "checkpoint (comma-separated)",
                                           group="safety", resume="free", file=False)
    # --- where and how to compute ----------------------------------------------------------
    backend: str = option(RecipeOptions.backend, help="cpu (numpy) or cuda",
                          group="compute", resume="free", choices=BACKENDS)
    precision: str = option(RecipeOptions.precision,
                            help="matmul input precision (bf16/tf32: CUDA tensor cores, f32 "
                                 "accumulation, f32 everything else)",
                            group="compute", choices=PRECISIONS)
    checkpoint_activations: bool = option(RecipeOptions.checkpoint_activations,
                                          help="recompute each decoder block in the backward: "
                                               "less memory, at most one more forward of the "
                                               "blocks per step",
                                          group="compute", resume="free")
    base_memory: str | None = option(RecipeOptions.base_memory,
                                     help="cpu: keep a block-format base quantized and decode "
                                          "it just in time, or decode it to f32 once; none: "
                                          "$TOYGRAPH_BASE_MEMORY (auto: decode when it fits)",
                                     group="compute", resume="free", choices=BASE_MEMORY_MODES)
    quiet: bool = option(False, help="no progress line", group="compute", resume="free")

    def __post_init__(self):
        if isinstance(self.data, str):   # RunConfig(data="d.jsonl"): one file
            self.data = (self.data,)

    # --- what the fields say of themselves ---------------------------------------------------
    @classmethod
    def meta(cls, name: str) -> dict:
        return _FIELDS[name].metadata

    @classmethod
    def names(cls) -> list[str]:
        return list(_FIELDS)

    @classmethod
    def default(cls, name: str):
        f = _FIELDS[name]
        return MISSING if f.default is MISSING else f.default

    @classmethod
    def choices(cls, name: str):
        c = _FIELDS[name].metadata["choices"]
        return c() if callable(c) else c

    @classmethod
    def kind(cls, name: str) -> type:
        """The field's value type: bool, int, float, str, tuple (of str, comma-separated on
        the command line) or list (of str, one per repeated flag)."""
        return _KINDS[name]

    def options(self) -> dict:
        """Every option as plain JSON (what a checkpoint and ``run_start`` record)."""
        values = asdict(self)
        return {k: (list(values[k]) if isinstance(values[k], tuple) else values[k])
                for k in _FIELDS}

    @classmethod
    def for_every_recipe(cls, name: str) -> bool:
        """Whether option ``name`` is one every run takes (declared here, not by a recipe)."""
        return name in _SHARED

    @classmethod
    def recipes_using(cls, name: str) -> tuple[str, ...]:
        """The registered recipes that use option ``name``: every one, or those whose
        ``Options`` declare it."""
        return tuple(r for r, c in RECIPES.items()
                     if name in _SHARED or name in _option_names(c.Options))

    def used(self, name: str) -> bool:
        """Whether this run's recipe uses option ``name``."""
        return self.recipe in self.recipes_using(name)

    @classmethod
    def from_options(cls, given: dict) -> "RunConfig":
        """A RunConfig from a mapping of option names (the run file and the flags merged);
        a one-line error naming a required option that is missing."""
        for name in cls.names():
            if name not in given and cls.default(name) is MISSING:
                raise ToygraphError(f"{flag(name)} is required (on the command line or as "
                                    f"`{name}:` in a --config run file)")
        return cls(**given)

    # --- checks ------------------------------------------------------------------------------
    def validate(self):
        """Raise ToygraphError naming the flag of the first option that is out of range,
        of the wrong type, or set for a recipe that does not use it."""
        check_value("recipe", self.recipe)
        options = recipe_class(self.recipe).Options
        missing = sorted(_option_names(options) - set(self.names()))
        if missing:   # a recipe registered later with options of its own
            raise ToygraphError(f"--recipe {self.recipe}: its options {missing} are not run "
                                "options (a recipe's Options may only use RunConfig's fields)")
        for name in self.names():
            value = getattr(self, name)
            check_value(name, value)
            if not self.used(name) and differs(value, self.default(name)):
                raise ToygraphError(f"{flag(name)} is for --recipe "
                                    f"{', '.join(self.recipes_using(name))}, not {self.recipe}")
        if self.steps is not None and self.epochs is not None:
            raise ToygraphError("give --steps or --epochs, not both")
        why = precision_error(self.precision, self.backend)
        if why:
            raise ToygraphError(f"--precision {why}")
        for check in checks_of(options):   # the recipe's options against each other
            check(self)
        if self.min_lr > self.lr:
            raise ToygraphError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if 0 < self.diverge_factor <= 1:
            raise ToygraphError(f"--diverge-factor must be > 1 (0 = off), got {self.diverge_factor}")
        if self.patience and not self.val_split:
            raise ToygraphError("--patience needs a validation set (--val-split > 0)")
        if self.overwrite and self.resume:
            raise ToygraphError("give --resume or --overwrite, not both")
        if not str(self.out).strip():
            raise ToygraphError("--out must name a directory, got an empty string")
        unknown = sorted(set(self.allow_change) - set(self.names()))
        if unknown:
            raise ToygraphError(f"--allow-change: no options named {unknown}")


def _option_names(options: type) -> set[str]:
    return {f.name for f in fields(options)}


#: The options every run takes: the ones RunConfig declares itself (first, in its order).
_SHARED = tuple(RunConfig.__annotations__)
_FIELDS = {f.name: f for f in sorted(fields(RunConfig), key=lambda f: f.name not in _SHARED)}
_HINTS = typing.get_type_hints(RunConfig)


def _kind(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (tuple, list):
        return typing.get_origin(hint)
    return _kind(args[0]) if args else hint


_KINDS = {name: _kind(_HINTS[name]) for name in _FIELDS}


def flag(name: str) -> str:
    """The command-line flag of option ``name``."""
    return "--" + name.replace("_", "-")


def differs(value, default) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) != list(default)
    return value != default


def check_value(name: str, value) -> None:
    """The field's type, choices and bounds (None is fine for an optional field)."""
    kind, meta = RunConfig.kind(name), RunConfig.meta(name)
    if value is None and RunConfig.default(name) is None:
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise ToygraphError(f"{flag(name)} must be true or false, got {excerpt(value)}")
        return
    if kind in (tuple, list):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ToygraphError(f"{flag(name)} must be a list of names, got {excerpt(value)}")
        return
    if kind is str:
        if not isinstance(value, str):
            raise ToygraphError(f"{flag(name)} must be text, got {excerpt(value)}")
        choices = RunConfig.choices(name)
        if choices and value not in choices:
            raise ToygraphError(f"{flag(name)} must be one of {', '.join(choices)}, got {excerpt(value)}")
        return
    low, high, open_low = meta["low"], meta["high"], meta["open_low"]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
                or (high is not None and value >= high):
            rng = f">= {low}" + (f" and < {high}" if high is not None else "")
            raise ToygraphError(f"{flag(name)} must be an integer {rng}, got {excerpt(value)}")
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if open_low else value >= low))
    ok = ok and (high is None or value < high)
    if not ok:
        rng = (f"{'>' if open_low else '>='} {low}" if low is not None else "") \
            + (f" and < {high}" if high is not None else "")
        raise ToygraphError(f"{flag(name)} must be a finite number {rng}, got {excerpt(value)}")
    if abs(value) > F32_MAX:   # the hyperparameters reach the graph as 32-bit floats: inf
        raise ToygraphError(f"{flag(name)} must be at most {F32_MAX:.3g} (a 32-bit float), "
                            f"got {excerpt(value)}")


def coerce(name: str, value):
    """A value from a run file or the command line in the field's type where the meaning
    is plain: "q,v" for a list, a number written as text ("1e-3": YAML reads it as a
    string) for a number. Anything else is left for ``validate`` to refuse."""
    kind = RunConfig.kind(name)
    if kind is tuple and isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if kind is list and isinstance(value, str):   # one item: a list is never split
        return (value,)
    if kind in (tuple, list) and isinstance(value, list):
        return tuple(str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                     for v in value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and name in ("model", "data", "out", "resume", "adapter_init"):
        return str(value)
    return value


def check_against_model(run_cfg: RunConfig, model_cfg) -> None:
    """Options that depend on the model: context length and LoRA rank vs matrix widths."""
    if run_cfg.seq_len > model_cfg.n_ctx:
        raise ToygraphError(f"--seq-len {run_cfg.seq_len} exceeds the model's context length "
                            f"{model_cfg.n_ctx}")
    if not recipe_class(run_cfg.recipe).trains_adapter:
        return
    LoraConfig(targets=tuple(run_cfg.targets), rank=run_cfg.rank, alpha=run_cfg.alpha)  # names checked
    d, ff = model_cfg.n_embd, model_cfg.n_ff
    # per layer: Gemma 4's sliding and global layers have different head sizes and counts
    q = min(a.heads * a.head_dim for a in model_cfg.attention)
    kv = min(a.kv_heads * a.head_dim for a in model_cfg.attention)
    widths = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d),
              "gate": (d, ff), "up": (d, ff), "down": (ff, d)}
    if model_cfg.n_expert:   # the experts' matrices (a dense model refuses these targets)
        widths.update(gate_up_exps=(d, 2 * model_cfg.n_ff_exp), down_exps=(model_cfg.n_ff_exp, d))
    for t in (t for t in expand_targets(run_cfg.targets) if t in widths):
        limit = min(widths[t])
        if run_cfg.rank > limit:
            raise ToygraphError(f"--rank {run_cfg.rank} exceeds the {t} matrix's smaller side "
                                f"{limit} (a rank above it adds nothing); use --rank <= {limit}")


def recipe_options(run_cfg: RunConfig, ranks: int = 1) -> RecipeOptions:
    """The RecipeOptions of a run: the options both declare, by one name; ``--batch`` is the
    job's batch, so with several ranks each realizes its share of it."""
    shared = {name: getattr(run_cfg, name) for name in RecipeOptions.names()
              if name in _FIELDS}
    return RecipeOptions(**{**shared, "batch": run_cfg.batch // ranks,
                            "data_parallel": ranks > 1})
