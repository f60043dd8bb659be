"""``toygraph finetune``: the flags of a run (toygraph.training.run_config) and the run."""
from __future__ import annotations

import json

from toygraph.cli.args import add_backend_args
from toygraph.models.catalog import resolve_model


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip().replace("-", "_") for t in text.split(",") if t.strip())


def train_config_from_args(args):
    """A TrainConfig from the parsed flags: every field of the dataclass with a flag."""
    from dataclasses import fields

    from toygraph.training.run_config import TrainConfig
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    given.update(model=resolve_model(args.model), allow_change=_names(args.allow_change),
                 targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()))
    return TrainConfig(**given)


#: Exit codes of ``finetune`` by run status (errors before or during the run exit 2).
EXIT_CODES = {"completed": 0, "early_stopped": 0, "diverged": 3, "interrupted": 130}


def cmd_finetune(args):
    from toygraph.core.distributed import world
    from toygraph.training.run import run_training
    summary = run_training(train_config_from_args(args))
    if world().rank == 0:  # under mpirun every rank returns the same summary
        print(json.dumps(summary))
    return EXIT_CODES.get(summary["status"], 1)


def add_finetune_parser(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a GGUF model on a JSONL dataset")
    _add_finetune_args(p)
    p.set_defaults(fn=cmd_finetune)


def _add_finetune_args(p):
    from toygraph.training.run_config import RECIPES, TrainConfig
    d = TrainConfig("", "", "")  # defaults come from the dataclass
    p.add_argument("--model", required=True, help="GGUF file, or 'smollm2'")
    p.add_argument("--data", required=True, help="JSONL: instruction/response, alpaca, chat or "
                   "text; preference pairs for dpo/orpo")
    p.add_argument("--out", required=True, help="run directory (adapter, checkpoints, events)")
    p.add_argument("--recipe", default=d.recipe, choices=list(RECIPES),
                   help="dpo/orpo: preference tuning on {prompt, chosen, rejected} pairs")
    p.add_argument("--targets", default=",".join(d.targets), help="LoRA targets among q,k,v,o,gate,up,down")
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--beta", type=float, default=d.beta,
                   help="dpo: strength of the pull towards the reference; orpo: odds-ratio weight")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing,
                   help="dpo: assumed chance a pair's preference is flipped (conservative DPO)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int)
    g.add_argument("--epochs", type=float)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--schedule", default=d.schedule, choices=["constant", "cosine", "linear"])
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--clip", type=float, default=d.clip, help="global grad-norm clip; 0 = off")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--val-split", type=float, default=d.val_split, help="0 = no validation")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="0 = every epoch and at the end")
    p.add_argument("--patience", type=int, default=d.patience, help="early stopping; 0 = off")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also checkpoint every N steps (evaluations always checkpoint); 0 = off")
    p.add_argument("--save-minutes", type=float, default=d.save_minutes,
                   help="checkpoint every N minutes; 0 = off")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                   help="step checkpoints kept (best/ is kept apart)")
    p.add_argument("--diverge-factor", type=float, default=d.diverge_factor,
                   help="stop as diverged when a loss exceeds this x the running median; 0 = off")
    p.add_argument("--adapter-init", help="start from this PEFT adapter directory")
    p.add_argument("--resume", help="run directory (its newest good checkpoint) or checkpoint to continue")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--allow-change", default="",
                   help="comma-separated options that may differ from the resumed checkpoint")
    p.add_argument("--max-examples", type=int)
    add_backend_args(p)
    p.add_argument("--checkpoint-activations", action="store_true",
                   default=d.checkpoint_activations,
                   help="recompute each decoder block in the backward instead of keeping its "
                        "activations: less memory, at most one more forward of the blocks per step")
    p.add_argument("--pack", action="store_true", default=d.pack,
                   help="pack several examples into each --seq-len row (attention stays inside each)")
    p.add_argument("--quiet", action="store_true")


