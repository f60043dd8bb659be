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


def cmd_tokenize(args):
    from .tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(resolve_model(args.model))
    print(json.dumps(tok.encode(args.text)))


def cmd_eval(args):
    from .inference import LanguageModel
    lm = LanguageModel(resolve_model(args.model), adapter_dir=args.adapter, backend=args.backend)
    if args.tokens is not None:
        loss, n = lm.loss(_parse_ids(args.tokens))
    elif args.text is not None:
        loss, n = lm.loss(lm.tokenizer.encode(args.text, add_bos=None))
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
    from .inference import LanguageModel
    lm = LanguageModel(resolve_model(args.model), adapter_dir=args.adapter, backend=args.backend)
    from .sampling import generation_kwargs  # streams the text to stdout as it is produced
    lm.generate(args.prompt, chat=args.chat, **generation_kwargs(args, print_to=sys.stdout))
    print()


def train_config_from_args(args):
    from .train import TrainConfig
    return TrainConfig(
        model=resolve_model(args.model), data=args.data, out=args.out, recipe=args.recipe,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()), rank=args.rank,
        alpha=args.alpha, steps=args.steps, epochs=args.epochs, batch=args.batch,
        grad_accum=args.grad_accum, seq_len=args.seq_len, lr=args.lr, schedule=args.schedule,
        warmup=args.warmup, clip=args.clip, weight_decay=args.weight_decay, seed=args.seed,
        val_split=args.val_split, eval_every=args.eval_every, patience=args.patience,
        save_every=args.save_every, adapter_init=args.adapter_init, resume=args.resume,
        backend=args.backend, max_examples=args.max_examples, quiet=args.quiet)


def cmd_finetune(args):
    from .train import run_training
    summary = run_training(train_config_from_args(args))
    print(json.dumps(summary))
    return 130 if summary["status"] == "interrupted" else 0


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
    return run_demo(out=args.out, steps=args.steps, backend=args.backend)


def _add_finetune_args(p):
    p.add_argument("--model", required=True, help="GGUF file, or 'smollm2'")
    p.add_argument("--data", required=True, help="JSONL: instruction/response, alpaca, chat or text")
    p.add_argument("--out", required=True, help="run directory (adapter, checkpoints, events)")
    p.add_argument("--recipe", default="lora", choices=["lora", "full", "scratch"])
    p.add_argument("--targets", default="q,v", help="LoRA targets among q,k,v,o,gate,up,down")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int)
    g.add_argument("--epochs", type=float)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", default="cosine", choices=["constant", "cosine", "linear"])
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip; 0 = off")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--val-split", type=float, default=0.1, help="0 = no validation")
    p.add_argument("--eval-every", type=int, default=0, help="0 = every epoch and at the end")
    p.add_argument("--patience", type=int, default=0, help="early stopping; 0 = off")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--adapter-init", help="start from this PEFT adapter directory")
    p.add_argument("--resume", help="checkpoint directory (or run directory) to continue")
    p.add_argument("--max-examples", type=int)
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
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
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
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
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("gate", help="check (or --record) the golden loss curves")
    p.add_argument("names", nargs="*", help="experiments (default: all)")
    p.add_argument("--record", action="store_true")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(fn=cmd_gate)

    p = sub.add_parser("demo", help="short LoRA fine-tune of SmolLM2 on the capitals set")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(fn=cmd_demo)
    add_export_parser(sub)
    add_chat_parser(sub)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ToygraphError as e:
        print(f"toygraph {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # argument values the library rejected before any work
        print(f"toygraph {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
