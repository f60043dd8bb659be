"""How a run option is declared, and the options every recipe of a kind takes.

A recipe says which options it takes by its ``Options`` class attribute: a dataclass of
``option(...)`` fields, each with its type, default, help text, group, resume rule and
bounds. A recipe module declares the options only it (and its subclasses) use beside its
class -- GRPO's sampling and objective in grpo.py, DPO's label smoothing in dpo.py -- and
the kinds of recipe share the ones here: every adapter recipe the adapter's shape
(``AdapterOptions``), every recipe of unpaired rows packing (``PackingOptions``).
``RunConfig`` (toygraph/training/run_config.py) is the options every run shares plus every
built-in recipe's, so the flags, the YAML run file and the resume rules still come from
one place, and a recipe takes exactly the fields of its ``Options``:

>>> "label_smoothing" in {f.name for f in fields(DPO.Options)}     # doctest: +SKIP
True

``check(cfg)`` on an options class checks its options against each other (``cfg`` is the
whole RunConfig); ``RunConfig.validate`` runs the checks of the recipe's classes.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field

from toygraph.adapters.files import MAX_LORA_SCALE, lora_scale
from toygraph.adapters.modelfile import ollama_name_error
from toygraph.errors import ToygraphError
from toygraph.inference.fidelity import QUANTS
from toygraph.models.decoder import LoraConfig

#: How a resumed run treats an option: "same" must match the checkpoint unless
#: ``--allow-change`` lists it; "free" may change (it steers how the run is carried out, or
#: is compared by content: model, data, the reference adapter); "never" shapes the
#: trainable tensors, so a checkpoint cannot load across it.
RESUME_RULES = ("same", "free", "never")
#: The groups of the help text and of the settings block, in order.
GROUPS = {"run": "what to train", "adapter": "LoRA adapters", "steps": "steps and batches",
          "optimizer": "optimizer and schedule", "evaluation": "evaluation",
          "safety": "checkpoints, resume and safety", "compute": "where and how to compute"}


def option(default=MISSING, *, help: str, group: str, resume: str = "same", choices=None,
           low=None, high=None, open_low: bool = False, file: bool = True):
    """A run option (a dataclass field). ``low``/``high``: bounds (``high`` exclusive,
    ``low`` exclusive when ``open_low``); ``choices``: the allowed values (a callable gives
    them late: the registered recipes); ``file``: whether the run file the run directory
    keeps holds it (False for the options that only steer one invocation: resume,
    overwrite, allow_change)."""
    assert group in GROUPS and resume in RESUME_RULES
    meta = {"help": help, "group": group, "resume": resume, "choices": choices, "low": low,
            "high": high, "open_low": open_low, "file": file}
    return field(default=default, metadata=meta)


def checks_of(options: type) -> list:
    """The ``check`` methods an options class and its bases define, base first."""
    return [vars(c)["check"] for c in reversed(options.__mro__) if "check" in vars(c)]


@dataclass(kw_only=True)
class PackingOptions:
    """What a recipe of unpaired rows takes (a pair is two rows of one batch, a GRPO row a
    prompt and its sampled completion: neither packs)."""

    pack: bool = option(False, help="pack several examples into each --seq-len row "
                                    "(attention stays inside each)", group="steps")


@dataclass(kw_only=True)
class AdapterOptions:
    """What every recipe that trains a LoRA adapter on the frozen base takes."""

    # models by name (issue 26): hand the trained adapter back to Ollama under a new name
    to_ollama: str | None = option(None, help="after training, `ollama create` this model name "
                                              "from the run's Modelfile (FROM the base, ADAPTER "
                                              "the adapter, the run's template), or print that "
                                              "command when ollama is not on PATH",
                                   group="run", resume="free")
    targets: tuple[str, ...] = option(LoraConfig.targets,
                                      help="LoRA targets among q,k,v,o,gate,up,down (Qwen3.5's "
                                           "DeltaNet layers: qkv,z,alpha,beta,ssm_out; a mixture "
                                           "of experts' experts: gate_up_exps,down_exps, or "
                                           "both as experts)",
                                      group="adapter", resume="never")
    rank: int = option(LoraConfig.rank, help="LoRA rank", group="adapter", resume="never", low=1)
    alpha: float = option(LoraConfig.alpha, help="LoRA alpha (the update is scaled by "
                                                 "alpha / rank)",
                          group="adapter", low=0, open_low=True)
    adapter_init: str | None = option(None, help="start from this PEFT adapter directory (dpo: "
                                                 "also the frozen reference)",
                                      group="adapter", resume="free")
    other_base: bool = option(False, help="apply --adapter-init although it records another "
                                          "base model (a one-line warning instead of the "
                                          "refusal)", group="adapter", resume="free", file=False)
    fidelity: tuple[str, ...] = option(("q8_0", "q4_k"),
                                       help="at the end, when there is a validation split: the "
                                            "adapter's loss and KL with the base requantized to "
                                            "these block types, on its first 8 rows (`toygraph "
                                            "eval --quants` for the whole split); none: off",
                                       group="evaluation", resume="free")

    def check(cfg):
        scale = lora_scale(cfg.alpha, cfg.rank, cfg.rslora)
        if scale > MAX_LORA_SCALE:
            raise ToygraphError(f"--alpha {cfg.alpha:g} with --rank {cfg.rank} scales the update "
                                f"by {scale:.4g}, above {MAX_LORA_SCALE:g}: LoRA uses about 0.5 to "
                                "4 (--alpha of one to two times --rank), and far above that the "
                                "update drowns the model (a typo?)")
        if cfg.to_ollama is not None and ollama_name_error(cfg.to_ollama):
            raise ToygraphError(f"--to-ollama {ollama_name_error(cfg.to_ollama)}")
        bad = [t for t in cfg.fidelity if t not in (*QUANTS, "none")]
        if bad:
            raise ToygraphError(f"--fidelity: {bad[0]!r} is not a block type; choose among "
                                f"{', '.join(QUANTS)}, or none")
