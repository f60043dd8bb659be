"""The ``toygraph`` command line: tokenize, eval, finetune, generate, gate, demo, export, chat."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .chat import add_chat_parser
from .errors import ToygraphError
from .export import add_export_parser
from .sampling import add_sampling_args


def resolve_model(name: str) -> str:
    """A GGUF path, or the name ``smollm2`` (fetched once into the cache)."""
    if name.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        from toygraph.fixtures.smollm2 import smollm2_path
        return str(smollm2_path())
    if not Path(name).is_file():
        raise ToygraphError(f"--model {name}: no such file (give a .gguf path or 'smollm2')")
    return name


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ToygraphError(f"--tokens must be comma-separated integers, got {text!r}") from None


def _utf8(flag: str, text: str) -> str:
    """Command-line text as valid Unicode: undecodable bytes in argv arrive as lone
    surrogates (Python's surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate \\u{c:04x}"
        raise ToygraphError(f"{flag} is not valid UTF-8 text ({what} at character {e.start})") from None
    return text


def cmd_tokenize(args):
    from .tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(resolve_model(args.model))
    print(json.dumps(tok.encode(_utf8("--text", args.text))))


def add_backend_args(p, precision: bool = True) -> None:
    """``--backend`` and ``--precision`` (the matmuls' input precision), with the defaults of
    RecipeOptions and the choices of session.py, for every command that runs a model."""
    from toygraph.recipes import RecipeOptions
    from .session import BACKENDS, PRECISIONS
    p.add_argument("--backend", default=RecipeOptions.backend, choices=list(BACKENDS))
    if precision:
        p.add_argument("--precision", default=RecipeOptions.precision, choices=list(PRECISIONS),
                       help="matmul input precision (bf16/tf32: CUDA tensor cores, f32 "
                            "accumulation, f32 everything else)")


def language_model_from_args(args):
    """The LanguageModel of eval, generate and chat: --model, --adapter, --backend, --precision."""
    from .inference import LanguageModel
    from .session import precision_error
    why = precision_error(args.precision, args.backend)
    if why:
        raise ToygraphError(f"--precision {why}")
    return LanguageModel(resolve_model(args.model), adapter_dir=args.adapter,
                         backend=args.backend, precision=args.precision)


def cmd_eval(args):
    lm = language_model_from_args(args)
    if args.tokens is not None:
        loss, n = lm.loss(_parse_ids(args.tokens))
    elif args.text is not None:
        loss, n = lm.loss(lm.tokenizer.encode(_utf8("--text", args.text), add_bos=None))
    else:
        from .data import encode_dataset, load_examples
        enc = encode_dataset(load_examples(args.data), lm.tokenizer, lm.cfg.n_ctx - 1)
        if not enc.items:
            raise ToygraphError(f"{args.data}: no example has a target token")
        loss, n = lm.loss([e.tokens for e in enc.items], [e.target_mask for e in enc.items])
    result = {"loss": loss, "tokens": n, "perplexity": math.exp(min(loss, 700))}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss {loss:.6f}  tokens {n}  perplexity {result['perplexity']:.4f}")


def cmd_generate(args):
    if args.max_new_tokens < 0:
        raise ToygraphError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ToygraphError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise ToygraphError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    prompt = _utf8("--prompt", args.prompt)
    lm = language_model_from_args(args)
    from .sampling import generation_kwargs  # streams the text to stdout as it is produced
    lm.generate(prompt, chat=args.chat, **generation_kwargs(args, print_to=sys.stdout))
    print()


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip().replace("-", "_") for t in text.split(",") if t.strip())


def train_config_from_args(args):
    """A TrainConfig from the parsed flags: every field of the dataclass with a flag."""
    from dataclasses import fields

    from .config import TrainConfig
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    given.update(model=resolve_model(args.model), allow_change=_names(args.allow_change),
                 targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()))
    return TrainConfig(**given)


#: Exit codes of ``finetune`` by run status (errors before or during the run exit 2).
EXIT_CODES = {"completed": 0, "early_stopped": 0, "diverged": 3, "interrupted": 130}


def cmd_finetune(args):
    from .distributed import world
    from .train import run_training
    summary = run_training(train_config_from_args(args))
    if world().rank == 0:  # under mpirun every rank returns the same summary
        print(json.dumps(summary))
    return EXIT_CODES.get(summary["status"], 1)


def cmd_gate(args):
    from toygraph.fixtures.golden import check_all, record_all
    if args.record:
        for path in record_all(args.names or None, backend=args.backend):
            print(f"recorded {path}")
        return 0
    failures = 0
    for name, ok, detail in check_all(args.names or None, backend=args.backend):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        failures += not ok
    return 1 if failures else 0


def cmd_demo(args):
    from .demo import run_demo
    return run_demo(out=args.out, steps=args.steps, backend=args.backend, precision=args.precision)


def _add_finetune_args(p):
    from .config import RECIPES, TrainConfig
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="toygraph", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tokenize", help="print token ids of a text as JSON")
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.set_defaults(fn=cmd_tokenize)

    p = sub.add_parser("eval", help="mean next-token cross-entropy and perplexity")
    p.add_argument("--model", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids")
    src.add_argument("--text")
    src.add_argument("--data", help="JSONL dataset (loss on target tokens)")
    p.add_argument("--adapter", help="PEFT adapter directory")
    add_backend_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("finetune", help="fine-tune a GGUF model on a JSONL dataset")
    _add_finetune_args(p)
    p.set_defaults(fn=cmd_finetune)

    p = sub.add_parser("generate", help="greedy or sampled text")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_sampling_args(p)
    add_backend_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("gate", help="check (or --record) the golden loss curves")
    p.add_argument("names", nargs="*", help="experiments (default: all)")
    p.add_argument("--record", action="store_true")
    add_backend_args(p, precision=False)  # the golden curves are f32
    p.set_defaults(fn=cmd_gate)

    p = sub.add_parser("demo", help="short LoRA fine-tune of SmolLM2 on the capitals set")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the demo's recipe)")
    add_backend_args(p)
    p.set_defaults(fn=cmd_demo)
    add_export_parser(sub)
    add_chat_parser(sub)
    return ap


def _report(command: str, e: BaseException):
    try:
        print(f"toygraph {command}: error: {e}", file=sys.stderr, flush=True)
    except OSError:  # stderr itself is gone (a closed pipe): the exit code still says it
        pass


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ToygraphError, ValueError) as e:  # ValueError: values the library rejected up front
        _report(args.command, e)
        return 2
    except OSError as e:  # e.g. a broken pipe on the output; the run (if any) recorded it
        _report(args.command, e)
        return 1
    except KeyboardInterrupt:  # before or after a run's own handling (loading, realizing)
        _report(args.command, "interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
