"""The README's worked QLoRA fine-tune: Qwen2.5-Coder learns a house style for small
Python functions on the CPU, and what it learned is measured on held-out requests.

    python examples/typed_functions/coder_example.py --model qwen2.5-coder-1.5b --steps 30 --out runs/typed-functions
    python examples/typed_functions/coder_example.py --model qwen2.5-coder-1.5b --out runs/typed-functions --eval-only

Trains LoRA adapters (RECIPE below; --base-memory left at its default, auto: the frozen
base stays in the file's Q4_K_M blocks where the CPU engine computes on them) on
examples/typed_functions/train.jsonl: requests for small functions answered by the
function alone, with builtin type hints, a one-line "Return ..." docstring and one
return (examples/typed_functions/house_style.py). Then it asks the held-out requests
(heldout.jsonl: new names and constants on the training templates, and templates
training never shows) greedily, of the base model and of the base with the adapter, and
scores each reply: in the house format; passing its unit tests as it stands; and the
same two of the code fenced in it (a base model's code may be right in the wrong
wrapping). It prints the equivalent `toygraph finetune` command first (when it
trains), then one JSON line: training seconds (all of run_training) and seconds per step (the steps' own walls,
from events.jsonl), peak RSS after training and at the end, the loss curve, the four
shares before and after (also split into seen and unseen templates) with the reasons
replies missed the format, seconds per evaluated request, and a few sample replies.

--eval-only skips training: the base is scored, and the adapter in --out if there is one.
--limit N scores the first N held-out requests (they mix both kinds).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

from toygraph.adapters.files import WEIGHTS_FILE
from toygraph.cpu import engine
from toygraph.demo.capitals import loss_curve
from toygraph.inference.language_model import LanguageModel
from toygraph.models.catalog import resolve_model
from toygraph.training import RunConfig, run_training

EXAMPLE = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLE))   # the example's scripts are siblings, not a package
from house_style import verdict  # noqa: E402

TRAIN = EXAMPLE / "train.jsonl"
#: LoRA on every linear of the blocks (the adapters cost little beside the frozen
#: products); 4 rows a step of at most 109 tokens (seq_len 112: the graph's rows, in
#: steps of 16); no validation split (the held-out requests are the measure). The house
#: format is learned fast: on the first 10 held-out requests, 3 steps of this recipe took
#: Qwen2.5-Coder-0.5B from 0/10 replies in the format to 10/10 and 2 steps took the 1.5B
#: from 0/10 to 9/10; 30 steps (120 rows, 3/8 of a pass over the 320) leave room to
#: settle on all 40 at a cost a CPU can pay (~2 minutes a step for the 1.5B on 2 busy cores).
RECIPE = dict(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=16, alpha=32,
              batch=4, seq_len=112, lr=1e-3, warmup=3, schedule="cosine", val_split=0.0,
              seed=42)
STEPS = 30
#: A house reply is at most ~50 tokens; a base model's reply is prose, a fenced block and
#: more prose: generation stops at the block's closing fence (what is judged is before it).
MAX_NEW_TOKENS, STOP = 160, ("\n```\n",)
SAMPLES, MISSES = 3, 5


def finetune_command(model: str, out: str, steps: int, recipe: dict) -> str:
    """The `toygraph finetune` line that trains what this script trains."""
    flags = [f"--model {model}", f"--data {os.path.relpath(TRAIN)}", f"--out {out}",
             f"--steps {steps}"]
    for key, value in recipe.items():
        value = ",".join(value) if isinstance(value, tuple) else value
        flags.append(f"--{key.replace('_', '-')} {value}")
    return "toygraph finetune " + " ".join(flags)


def peak_rss_gb() -> float:
    """This process's peak resident set so far (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def ask_all(lm: LanguageModel, cases: list[dict]) -> tuple[list[str], dict]:
    """Every case's greedy reply, and the time it took."""
    replies, seconds, tokens = [], 0.0, 0
    for case in cases:
        replies.append(lm.generate(case["instruction"], chat=True, max_new_tokens=MAX_NEW_TOKENS,
                                   stop=STOP))
        seconds += lm.last_generation["seconds"]
        tokens += lm.last_generation["new_tokens"]
    return replies, {"s_per_request": round(seconds / len(cases), 1),
                     "new_tokens_per_s": round(tokens / seconds, 2)}


def scores(replies: list[str], cases: list[dict], timing: dict) -> dict:
    """The shares of the replies' verdicts, "k/n" overall and for seen/unseen templates,
    how often each way of missing the house format occurred, and the first replies that
    missed the format or failed their tests."""
    marks = [verdict(reply, case) for reply, case in zip(replies, cases)]
    shares = dict(timing)
    misses = [{"request": c["instruction"], "reply": r, "problems": m["problems"],
               "passes": m["passes"]}
              for c, r, m in zip(cases, replies, marks) if not (m["format"] and m["passes"])]
    for what in ("format", "passes", "code_format", "code_passes"):
        shares[what] = f"{sum(m[what] for m in marks)}/{len(marks)}"
        for group, seen in (("seen", True), ("unseen", False)):
            of = [m[what] for m, c in zip(marks, cases) if c["seen"] == seen]
            shares[f"{what}_{group}"] = f"{sum(of)}/{len(of)}"
    for what in ("problems", "code_problems"):
        missed = Counter(p.split(":")[0] for m in marks for p in m[what])
        shares[what] = dict(missed.most_common())
    shares["misses"] = misses[:MISSES]
    return shares


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default="runs/typed-functions")
    ap.add_argument("--eval-only", action="store_true",
                    help="no training: score the base, and the adapter in --out if any")
    ap.add_argument("--limit", type=int, default=None, help="score the first N held-out requests")
    ap.add_argument("--threads", type=int, default=None, help="as toygraph's --threads")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one RECIPE entry (a Python literal), e.g. lr=5e-4")
    args = ap.parse_args()
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be at least 1, got {args.limit}")
    recipe = dict(RECIPE)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in RunConfig.names():
            ap.error(f"--set {item}: {key!r} is not a RunConfig option")
        try:
            recipe[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"--set {item}: {value!r} is not a Python literal (quote strings)")
    engine.use_threads(args.threads)
    lines = (EXAMPLE / "heldout.jsonl").read_text(encoding="utf-8").splitlines()
    cases = [json.loads(line) for line in lines][:args.limit]
    model = resolve_model(args.model)
    result = {"model": args.model, "adapter": args.out}

    if not args.eval_only:
        command = finetune_command(args.model, args.out, args.steps, recipe)
        print(command, flush=True)
        result.update(steps=args.steps, recipe=recipe, command=command)
        t0 = time.perf_counter()
        run_training(RunConfig(model=model, data=[str(TRAIN)], out=args.out,
                               recipe="lora", steps=args.steps, overwrite=True, **recipe))
        train_s = time.perf_counter() - t0
        events = Path(args.out) / "events.jsonl"
        walls = [e["wall_ms"] / 1000 for e in map(json.loads, events.read_text().splitlines())
                 if e["event"] == "step"]
        result.update(train_s=round(train_s), s_per_step=round(sum(walls) / len(walls), 1),
                      s_first_step=round(walls[0], 1), s_outside_steps=round(train_s - sum(walls)),
                      peak_rss_train_gb=peak_rss_gb(), loss=loss_curve(events))

    replies, timing = ask_all(LanguageModel(model), cases)
    result["before"] = scores(replies, cases, timing)
    rows = [{"request": c["instruction"], "before": r} for c, r in zip(cases, replies)]
    if (Path(args.out) / WEIGHTS_FILE).exists():
        replies, timing = ask_all(LanguageModel(model, adapter_dir=args.out), cases)
        result["after"] = scores(replies, cases, timing)
        for row, reply in zip(rows, replies):
            row["after"] = reply
    result["peak_rss_gb"] = peak_rss_gb()
    result["prompts"] = len(cases)
    result["samples"] = rows[:SAMPLES]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
