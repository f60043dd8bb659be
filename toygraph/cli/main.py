"""The ``toygraph`` command line: tokenize, eval, finetune, generate, chat, export, demo,
models.

Further commands come from other installed packages through the ``toygraph.commands``
entry points (each a function that adds its sub-parser): ``toygraph gate`` is one, from
``toygraph.fixtures``, so the command line never imports the test fixtures itself.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from importlib.metadata import entry_points

from toygraph import __version__
from toygraph.cli.args import (add_adapter_arg, add_allow_merged_arg, add_backend_args,
                               add_model_arg, add_other_base_arg, add_sampling_args,
                               add_system_arg, add_template_arg, add_threads_arg,
                               check_sampling_args, eval_sequences, generation_kwargs,
                               language_model_from_args, use_threads_of, utf8)
from toygraph.cli.chat import add_chat_parser
from toygraph.cli.export import add_export_parser
from toygraph.cli.fidelity import add_fidelity_args, cmd_fidelity, refuse_report_flags
from toygraph.cli.finetune import add_finetune_parser
from toygraph.cli.models import add_models_parser
from toygraph.cli.parser import CommandParser
from toygraph.bounded import printable
from toygraph.demo.capitals import STEPS as DEMO_STEPS
from toygraph.errors import ToygraphError
from toygraph.limits import disk_full_text, out_of_memory_text
from toygraph.models.catalog import resolve_model
from toygraph.training.supervisor import rate_text


def cmd_tokenize(args):
    from toygraph.gguf.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(resolve_model(args.model))
    print(json.dumps(tok.encode(utf8("--text", args.text))))


def cmd_eval(args):
    if args.quants is not None:   # the fidelity report: its data may be the run's own
        return cmd_fidelity(args)
    refuse_report_flags(args)
    if args.tokens is None and args.text is None and args.data is None:
        raise ToygraphError("one of the arguments --tokens --text --data is required "
                            "(or --quants with a run directory's --adapter)")
    lm = language_model_from_args(args)
    loss, n = lm.loss(*eval_sequences(args, lm))
    if not math.isfinite(loss):   # an adapter or model whose numbers overflow: say so, not "nan"
        raise lm.not_finite(f"the loss is {loss} over {n} tokens")
    result = {"loss": loss, "tokens": n, "perplexity": math.exp(min(loss, 700))}
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        print(f"loss {loss:.6f}  tokens {n}  perplexity {result['perplexity']:.4f}")


def cmd_generate(args):
    check_sampling_args(args)
    prompt = utf8("--prompt", args.prompt)
    chat = args.chat or args.system is not None
    if args.system is not None:   # a system message only exists in a chat's turns
        prompt = [{"role": "system", "content": utf8("--system", args.system)},
                  {"role": "user", "content": prompt}]
    lm = language_model_from_args(args)
    lm.generate(prompt, chat=chat, **generation_kwargs(args, print_to=sys.stdout))
    print()
    g = lm.last_generation   # on stderr, so stdout stays the text alone
    print(f"{g['new_tokens']} tokens in {g['seconds']:.2f}s "
          f"({rate_text(g['new_tokens'] / max(g['seconds'], 1e-9))} tokens/s) after a "
          f"{g['prompt_tokens']}-token prompt{limit_text(g['stopped'], args, lm)}", file=sys.stderr)


def limit_text(stopped: str, args, lm) -> str:
    """What cut the text off when a limit did (the model did not end it): said, so a
    code answer cut mid-docstring is not taken for the whole answer."""
    if stopped == "max_new_tokens":
        return (f"; stopped at --max-new-tokens {args.max_new_tokens}; raise it for longer "
                "answers")
    if stopped == "context":
        return f"; stopped at the model's context of {lm.seq_len} tokens"
    return ""


def cmd_demo(args):
    from toygraph.demo.capitals import run_demo
    return run_demo(out=args.out, steps=args.steps, backend=args.backend, precision=args.precision)


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(prog="toygraph", description="Fine-tune language models straight from "
                       "GGUF files, and use the result.")
    ap.add_argument("--version", action="version", version=f"toygraph {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tokenize", help="print token ids of a text as JSON")
    add_model_arg(p)
    p.add_argument("--text", required=True, help="the text to tokenize")
    p.set_defaults(fn=cmd_tokenize)

    p = sub.add_parser("eval", help="mean next-token cross-entropy and perplexity")
    add_model_arg(p)
    src = p.add_mutually_exclusive_group()   # one is required, but for --quants (cmd_eval)
    one_of = " (one of --tokens, --text or --data is required, but with --quants)"
    src.add_argument("--tokens", help="comma-separated token ids to score" + one_of)
    src.add_argument("--text", help="a text to score, tokenized as generate would" + one_of)
    src.add_argument("--data", help="JSONL dataset: the loss on its target tokens" + one_of)
    add_adapter_arg(p)
    add_fidelity_args(p)
    add_backend_args(p)
    add_template_arg(p)
    add_allow_merged_arg(p)
    add_other_base_arg(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(fn=cmd_eval)

    add_finetune_parser(sub)

    p = sub.add_parser("generate", help="greedy or sampled text")
    add_model_arg(p)
    add_adapter_arg(p)
    p.add_argument("--prompt", required=True, help="the text to continue (or, with --chat, "
                                                   "the user's message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_system_arg(p, "before the prompt (implies --chat)")
    add_sampling_args(p)
    add_backend_args(p)
    add_template_arg(p)
    add_allow_merged_arg(p)
    add_other_base_arg(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("demo", help="short LoRA fine-tune of SmolLM2 on the capitals set")
    p.add_argument("--out", default="runs/demo", help="run directory of the demo's fine-tune")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default: the demo's recipe, "
                                             f"{DEMO_STEPS})")
    add_backend_args(p)
    p.set_defaults(fn=cmd_demo)
    add_export_parser(sub)
    add_chat_parser(sub)
    add_models_parser(sub)
    for plugin in entry_points(group="toygraph.commands"):
        plugin.load()(sub)
    for name, command in sub.choices.items():
        if name not in WITHOUT_COMPUTE:
            add_threads_arg(command)
    return ap


#: Commands that compute nothing on the CPU engine or BLAS, so take no --threads.
WITHOUT_COMPUTE = ("tokenize", "models")


def _report(command: str, e: BaseException | str):
    # an error may quote text from a file (a template's raise_exception, a name): its
    # control characters are shown escaped, never sent to the terminal
    try:
        # one write, newline included: ranks of one job share the stream, and a line
        # written in two parts interleaves with another rank's
        sys.stderr.write(f"toygraph {command}: error: {printable(e, keep_newlines=True)}\n")
        sys.stderr.flush()
    except OSError:  # stderr itself is gone (a closed pipe): the exit code still says it
        pass


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        use_threads_of(args)
        return int(args.fn(args) or 0)
    except (ToygraphError, ValueError) as e:  # ValueError: values the library rejected up front
        _report(args.command, e)
        return 2
    except OSError as e:  # e.g. a broken pipe on the output; the run (if any) recorded it
        _report(args.command, disk_full_text(e) or e)
        return 1
    except MemoryError as e:  # a numpy allocation past ulimit -v, a cgroup limit, the machine
        _report(args.command, out_of_memory_text(e))
        return 1
    except KeyboardInterrupt:  # before or after a run's own handling (loading, realizing)
        _report(args.command, "interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
