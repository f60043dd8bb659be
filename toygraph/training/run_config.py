"""The options of a fine-tuning run, declared once: ``RunConfig``.

Every field carries its type, its default, a help text, the recipes that use it (None:
every recipe), how a resumed run treats it and its bounds. Everything else comes from
here: the ``toygraph finetune`` flags (toygraph/cli/finetune.py), the YAML run file
(``--config run.yaml``; the keys are the field names), the ``run.yaml`` kept in the run
directory, which repeats the run, and the settings block printed when a run starts (all
three run_file.py), the resume-compatibility check (resume.py) and ``run_start`` in
``events.jsonl``:

>>> cfg = RunConfig(model="m.gguf", data="d.jsonl", out="runs/x", steps=50)   # doctest: +SKIP
>>> run_training(cfg)                                                         # doctest: +SKIP

Defaults are written once, in the lowest layer that uses them: the LoRA shape, seed and
init scale in ``LoraConfig`` (models/decoder.py), the step shape, clip, precision and
backend in ``RecipeOptions`` (recipes/base.py), the preference strengths in their recipe
modules; the fields here read them from there. ``validate`` checks each option on its
own and against the others; ``check_against_model`` what depends on the model. Errors
name the flag.
"""
from __future__ import annotations

import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from toygraph.adapters.files import MAX_LORA_SCALE, lora_scale
from toygraph.adapters.modelfile import ollama_name_error
from toygraph.bounded import excerpt
from toygraph.core.frozen_base import MODES as BASE_MEMORY_MODES
from toygraph.precision import BACKENDS, PRECISIONS, precision_error
from toygraph.errors import ToygraphError
from toygraph.models.catalog import model_forms
from toygraph.models.decoder import LoraConfig, expand_targets
from toygraph.recipes import RECIPES, LoRA, RecipeOptions, recipe_class
from toygraph.recipes.dpo import DPO, LABEL_SMOOTHING
from toygraph.recipes.grpo import (GRPO, MAX_COMPLETION_LENGTH, MAX_TOOL_CALLS, NUM_GENERATIONS,
                                   NUM_ITERATIONS, TEMPERATURE, TOP_P)
from toygraph.recipes.grpo_loss import IMPORTANCE_SAMPLING, LOSS_TYPES, SCALE_REWARDS, Objective
from toygraph.recipes.preference import BETA, PreferenceRecipe
from toygraph.recipes.rewards import REWARD_TIMEOUT
from toygraph.recipes.tools import STYLES as TOOL_CALL_STYLES

#: How a resumed run treats an option: "same" must match the checkpoint unless
#: ``--allow-change`` lists it; "free" may change (it steers how the run is carried out, or
#: is compared by content: model, data, the reference adapter); "never" shapes the
#: trainable tensors, so a checkpoint cannot load across it.
RESUME_RULES = ("same", "free", "never")
#: The largest float32: every float option must fit one (the step's hyperparameters are an
#: f32 tensor; --epochs times the rows is a step count).
F32_MAX = 3.4028234663852886e38
#: The groups of the help text and of the settings block, in order.
GROUPS = {"run": "what to train", "adapter": "LoRA adapters", "steps": "steps and batches",
          "optimizer": "optimizer and schedule", "evaluation": "evaluation",
          "safety": "checkpoints, resume and safety", "compute": "where and how to compute"}


def option(default=MISSING, *, help: str, group: str, used_by=None, resume: str = "same",
           choices=None, low=None, high=None, open_low: bool = False, file: bool = True):
    """A RunConfig field. ``used_by``: a test on the recipe class saying which recipes use
    the option (None: every recipe), so a new recipe gets the options of what it is (an
    adapter recipe, a preference recipe) without being listed; ``low``/``high``: bounds
    (``high`` exclusive, ``low`` exclusive when ``open_low``); ``choices``: the allowed
    values (a callable gives them late: the registered recipes); ``file``: whether the run
    file the run directory keeps holds it (False for the options that only steer one
    invocation: resume, overwrite, allow_change)."""
    assert group in GROUPS and resume in RESUME_RULES
    meta = {"help": help, "group": group, "used_by": used_by, "resume": resume,
            "choices": choices, "low": low, "high": high, "open_low": open_low, "file": file}
    return field(default=default, metadata=meta)


def _recipes_help() -> str:
    """The --recipe help, from the registered recipes themselves."""
    return "what trains: " + "; ".join(f"{name} ({cls.summary})" if cls.summary else name
                                       for name, cls in RECIPES.items())


def _adapter_recipes(recipe) -> bool:
    return recipe.trains_adapter


def _lora_recipe(recipe) -> bool:
    # the plain LoRA recipe only: the preference and GRPO recipes (its subclasses) build
    # reference and sampling passes that do not take the variants
    return recipe is LoRA


def _preference_recipes(recipe) -> bool:
    return issubclass(recipe, PreferenceRecipe)


def _grpo_recipes(recipe) -> bool:
    return issubclass(recipe, GRPO)


def _packing_recipes(recipe) -> bool:
    # a pair is two rows of one batch; a GRPO row is a prompt and its sampled completion
    return not issubclass(recipe, (PreferenceRecipe, GRPO))


@dataclass
class RunConfig:
    """Every option of a fine-tuning run (see the module docstring)."""

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
    reward: list[str] = option((), help="grpo: a reward function (repeat the flag for more): "
                                        "regex:PATTERN, exact:FIELD, json, json-schema:FILE, "
                                        "length:MIN:MAX, or module:function (TRL's signature)",
                               group="run", used_by=_grpo_recipes)
    reward_weights: tuple[str, ...] | None = option(None, help="grpo: the --reward functions' weights, "
                                                      "comma-separated; none: 1 each",
                                             group="run", used_by=_grpo_recipes)
    reward_timeout: float = option(REWARD_TIMEOUT, help="grpo: seconds a module:function "
                                                        "reward or an environment may take per "
                                                        "call (each runs in a process of its "
                                                        "own); 0 = no limit",
                                   group="run", used_by=_grpo_recipes, resume="free", low=0)
    # GRPO over turns (issue 50, recipes/episodes.py): tools the completions call, an
    # environment that answers each turn
    tools: str | None = option(None, help="grpo: a Python file whose functions (type hints and "
                                          "a docstring each) the model may call: their JSON "
                                          "schemas reach the chat template's tools, each call "
                                          "is run (10 s at most) and its reply fed back as a "
                                          "tool turn",
                               group="run", used_by=_grpo_recipes)
    max_tool_calls: int = option(MAX_TOOL_CALLS, help="grpo: tool calls one completion may make "
                                                      "(with --tools); past them its calls get "
                                                      "no reply",
                                 group="run", used_by=_grpo_recipes, low=1)
    tool_call_style: str | None = option(None, help="grpo: how the model writes a tool call "
                                                    "(with --tools): hermes/qwen (<tool_call> "
                                                    "tags), llama3, or json (a turn that is a "
                                                    "bare or ```json-fenced {\"name\", "
                                                    "\"arguments\"} object); default: the "
                                                    "format the chat template shows",
                                         group="run", used_by=_grpo_recipes,
                                         choices=TOOL_CALL_STYLES)
    environment: str | None = option(None, help="grpo: what answers each turn of an episode: "
                                                "env.py:Factory or module:Factory (reset(prompt) "
                                                "-> observation, step(text) -> (observation, "
                                                "reward, done)), or guess (a built-in guessing "
                                                "game); its reward takes one more "
                                                "--reward-weights entry, the last",
                                     group="run", used_by=_grpo_recipes)
    # models by name (issue 26): hand the trained adapter back to Ollama under a new name
    to_ollama: str | None = option(None, help="after training, `ollama create` this model name "
                                              "from the run's Modelfile (FROM the base, ADAPTER "
                                              "the adapter, the run's template), or print that "
                                              "command when ollama is not on PATH",
                                   group="run", used_by=_adapter_recipes, resume="free")
    # --- LoRA adapters ---------------------------------------------------------------------
    targets: tuple[str, ...] = option(LoraConfig.targets,
                                      help="LoRA targets among q,k,v,o,gate,up,down (Qwen3.5's DeltaNet "
                                           "layers: qkv,z,alpha,beta,ssm_out; a mixture of "
                                           "experts' experts: gate_up_exps,down_exps, or "
                                           "both as experts)",
                                      group="adapter", used_by=_adapter_recipes, resume="never")
    rank: int = option(LoraConfig.rank, help="LoRA rank", group="adapter", used_by=_adapter_recipes,
                       resume="never", low=1)
    alpha: float = option(LoraConfig.alpha, help="LoRA alpha (the update is scaled by "
                                                 "alpha / rank)",
                          group="adapter", used_by=_adapter_recipes, low=0, open_low=True)
    adapter_init: str | None = option(None, help="start from this PEFT adapter directory (dpo: "
                                                 "also the frozen reference)",
                                      group="adapter", used_by=_adapter_recipes, resume="free")
    other_base: bool = option(False, help="apply --adapter-init although it records another "
                                          "base model (a one-line warning instead of the "
                                          "refusal)", group="adapter", used_by=_adapter_recipes,
                              resume="free", file=False)
    beta: float = option(BETA, help="dpo: strength of the pull towards the "
                                                "reference; orpo: odds-ratio weight",
                         group="adapter", used_by=_preference_recipes, low=0, open_low=True)
    label_smoothing: float = option(LABEL_SMOOTHING,
                                    help="dpo: assumed chance a pair's preference is flipped "
                                         "(conservative DPO)",
                                    group="adapter", used_by=lambda recipe: issubclass(recipe, DPO), low=0, high=0.5)
    # --- LoRA variants (issue 26 item 4; LoraConfig's docstring) ---
    rslora: bool = option(LoraConfig.rslora, help="rsLoRA: scale the update by alpha / "
                                                  "sqrt(rank) instead of alpha / rank",
                          group="adapter", used_by=_lora_recipe)
    dora: bool = option(LoraConfig.dora, help="DoRA: a trainable magnitude per output row "
                                              "times the direction of W + scale * B A",
                        group="adapter", used_by=_lora_recipe, resume="never")
    lora_plus_ratio: float = option(LoraConfig.plus_ratio,
                                    help="LoRA+: the B matrices' learning rate is the peak "
                                         "learning rate times this (A's: that rate)",
                                    group="adapter", used_by=_lora_recipe, low=0, open_low=True)
    lora_dropout: float = option(LoraConfig.dropout, help="dropout on each adapter's input "
                                                          "while training (not with --dora)",
                                 group="adapter", used_by=_lora_recipe, low=0, high=1)
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
    pack: bool = option(RecipeOptions.pack, help="pack several examples into each --seq-len "
                                                 "row (attention stays inside each)",
                        group="steps", used_by=_packing_recipes)
    num_generations: int = option(NUM_GENERATIONS, help="grpo: completions sampled per prompt "
                                                        "(a group)",
                                  group="steps", used_by=_grpo_recipes, low=2)
    max_completion_length: int = option(MAX_COMPLETION_LENGTH,
                                        help="grpo: tokens a completion has at most (--seq-len "
                                             "bounds the prompt)",
                                        group="steps", used_by=_grpo_recipes, low=1)
    temperature: float = option(TEMPERATURE, help="grpo: sampling temperature (the log-probs "
                                                  "are taken at it too, as TRL does)",
                                group="steps", used_by=_grpo_recipes, low=0, open_low=True)
    top_p: float = option(TOP_P, help="grpo: nucleus sampling mass, in (0, 1]; 1 = off",
                          group="steps", used_by=_grpo_recipes, low=0, open_low=True)
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
    num_iterations: int = option(NUM_ITERATIONS, help="grpo: optimizer steps per sampled batch "
                                                      "(the old log-probs are kept)",
                                 group="optimizer", used_by=_grpo_recipes, low=1)
    loss_type: str = option(Objective.loss_type, help="grpo: how per-token losses are averaged "
                                                      "(TRL's loss_type)",
                            group="optimizer", used_by=_grpo_recipes, choices=LOSS_TYPES)
    scale_rewards: str = option(Objective.scale_rewards,
                                help="grpo: divide advantages by the group's or the batch's "
                                     "reward std, or not",
                                group="optimizer", used_by=_grpo_recipes, choices=SCALE_REWARDS)
    importance_sampling: str = option(Objective.importance_sampling,
                                      help="grpo: importance ratio per token, or per sequence "
                                           "(GSPO)",
                                      group="optimizer", used_by=_grpo_recipes,
                                      choices=IMPORTANCE_SAMPLING)
    epsilon: float = option(Objective.epsilon, help="grpo: clip the ratio below 1 - epsilon",
                            group="optimizer", used_by=_grpo_recipes, low=0, high=1)
    epsilon_high: float | None = option(Objective.epsilon_high,
                                        help="grpo: clip the ratio above 1 + epsilon-high; none: "
                                             "epsilon (DAPO: 0.28)",
                                        group="optimizer", used_by=_grpo_recipes, low=0)
    kl_beta: float = option(Objective.beta, help="grpo: weight of the KL to the reference (the "
                                                 "adapter off); 0 = no reference pass",
                            group="optimizer", used_by=_grpo_recipes, low=0)
    # --- evaluation ------------------------------------------------------------------------
    val_split: float = option(0.1, help="fraction held out for validation; 0 = none",
                              group="evaluation", low=0, high=1)
    eval_every: int = option(0, help="evaluate every N steps; 0 = every epoch and at the end",
                             group="evaluation", low=0)
    patience: int = option(0, help="stop after N evaluations without a gain; 0 = off",
                           group="evaluation", low=0)
    fidelity: tuple[str, ...] = option(("q8_0", "q4_k"),
                                       help="at the end, when there is a validation split: the "
                                            "adapter's loss and KL with the base requantized to "
                                            "these block types, on its first 8 rows (`toygraph "
                                            "eval --quants` for the whole split); none: off",
                                       group="evaluation", used_by=_adapter_recipes,
                                       resume="free")
    log_completions: int = option(0, help="grpo: put a sampled completion in the step event "
                                          "every N steps; 0 = never",
                                  group="evaluation", used_by=_grpo_recipes, resume="free", low=0)
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
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def recipes_using(cls, name: str) -> tuple[str, ...]:
        """The registered recipes that use option ``name``."""
        test = cls.meta(name)["used_by"]
        return tuple(r for r, c in RECIPES.items() if test is None or test(c))

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
        scale = lora_scale(self.alpha, self.rank, self.rslora)
        if self.used("alpha") and scale > MAX_LORA_SCALE:
            raise ToygraphError(f"--alpha {self.alpha:g} with --rank {self.rank} scales the update "
                                f"by {scale:.4g}, above {MAX_LORA_SCALE:g}: LoRA uses about 0.5 to "
                                "4 (--alpha of one to two times --rank), and far above that the "
                                "update drowns the model (a typo?)")
        if self.dora and self.lora_dropout:   # PEFT would drop DoRA's base term's input too
            raise ToygraphError("--lora-dropout together with --dora is not supported")
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
        if self.to_ollama is not None and ollama_name_error(self.to_ollama):
            raise ToygraphError(f"--to-ollama {ollama_name_error(self.to_ollama)}")
        from toygraph.inference.fidelity import QUANTS
        bad = [t for t in self.fidelity if t not in (*QUANTS, "none")]
        if bad:
            raise ToygraphError(f"--fidelity: {bad[0]!r} is not a block type; choose among "
                                f"{', '.join(QUANTS)}, or none")
        if self.max_tool_calls != self.default("max_tool_calls") and self.tools is None:
            raise ToygraphError("--max-tool-calls needs --tools (the functions to call)")
        if self.tool_call_style is not None and self.tools is None:
            raise ToygraphError("--tool-call-style needs --tools (the functions to call)")
        if self.tools is not None and not Path(self.tools).is_file():
            raise ToygraphError(f"--tools {self.tools}: no such file")
        unknown = sorted(set(self.allow_change) - set(self.names()))
        if unknown:
            raise ToygraphError(f"--allow-change: no options named {unknown}")


_FIELDS = {f.name: f for f in fields(RunConfig)}
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
