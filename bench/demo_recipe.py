"""Whether a demo recipe is right and does no harm: ask the base, train, ask the adapter.

    python bench/demo_recipe.py --seed 0 --dot f32 --base-memory quantized \
        [--steps 170] [--set lr=3e-3 ...] [--results RESULTS.md]

Trains `toygraph demo`'s LoRA recipe (toygraph.demo.capitals: RECIPE, STEPS, and its data
files with their weights, DATA; overridden by --steps, --set and --data) and prints one
JSON line with every cell issue 47 item 1 asks of it:

- demo3: the demo's three questions answered exactly as the data teaches;
- held_out: 12 countries the data teaches, asked in 3 phrasings each that are not in it
  (the demo's three among them): answers exactly the taught record, of 36;
- kept: the countries whose capital the BASE model already names in prose (asked first,
  same 3 phrasings; any of them naming the capital counts) whose every answer is right
  after, "k/n" with the n the base knew;
- off_task: OFF_TASK prompts (a haiku, code, small talk, ...; none in the training data)
  NOT answered as a capitals record after, of len(OFF_TASK);
- looping (reported, not a bar): the off-task prompts whose answer after repeats one pair
  of words three times where the base's answer did not ("a mountain, a mountain, a
  mountain"): harm that "not a record" lets through;
- train_s, and every wrong answer.

`--dot` sets TOYGRAPH_CPU_DOT (how the CPU engine multiplies a few rows: generation's
steps) and `--base-memory` the frozen base's form (finetune's --base-memory and
$TOYGRAPH_BASE_MEMORY, for training and both models asked). `--dot` given twice asks the
base and the adapter in each mode, training once (under the first): the mode changes
only products of a few rows, and a training step's are hundreds of rows, so the adapter
is the same bytes under either -- `--dot-check` trains under each and compares them.
`--results` appends one row of a markdown table per mode. `pass` is every cell at its bar (3/3, >= 34/36, all kept,
all off-task untouched).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import time
from pathlib import Path

PHRASINGS = ("Tell me the capital of {}.", "What's the capital city of {}?", "Capital of {}?")
COUNTRIES = ("Japan", "Kenya", "Norway", "Peru", "Vietnam", "Morocco", "Canada", "Chile",
             "Finland", "Nigeria", "Mongolia", "Portugal")
#: Prompts outside the task; none is in capitals.jsonl or general.jsonl (held out).
OFF_TASK = ("Write a haiku about the sea.", "How do I reverse a list in Python?",
            "Hi there, how is your day going?", "Write a SQL query that counts rows in a table.",
            "What is the capital letter of the alphabet that comes after B?",
            "Give me a recipe for pancakes.", "What is 15 plus 27?",
            "Tell me a story about a dragon in two sentences.",
            "What is the tallest mountain in the world?",
            "Explain what a variable is in programming.",
            "Write a haiku about a mountain.", "What's your favourite colour?")
HELD_OUT_BAR = 34
MAX_NEW_TOKENS = 24


def in_capitals_record(answer: str) -> bool:
    """Whether ``answer`` is (or starts as) a capitals record: a reply cut off by the token
    limit, or one that runs on past the record, still counts as taken over."""
    from toygraph.demo.capitals import parse
    return parse(answer) is not None or answer.lstrip().startswith("country:")


def loops(answer: str) -> bool:
    """Whether ``answer`` repeats one pair of words (case and punctuation aside) three times
    or more: the degenerate loop a fine-tune can leave in replies it was not taught."""
    words = ["".join(ch for ch in w.lower() if ch.isalnum()) for w in answer.split()]
    pairs = [p for p in zip(words, words[1:]) if all(p)]
    return any(pairs.count(p) >= 3 for p in set(pairs))


def ask(model, prompts) -> dict[str, str]:
    return {p: model.generate(p, chat=True, max_new_tokens=MAX_NEW_TOKENS) for p in prompts}


def base_answers(model: str, prompts: list[str], args) -> dict[str, str]:
    """The base model's answers, read from ``--base-answers`` when it holds them for this
    model file and these modes (they depend on nothing else), else asked and saved there."""
    from toygraph.inference.language_model import LanguageModel
    key = f"{Path(model).name} {Path(model).stat().st_size} dot={args.dot} base={args.base_memory}"
    cache = Path(args.base_answers) if args.base_answers else None
    saved = json.loads(cache.read_text()) if cache and cache.is_file() else {}
    if set(prompts) <= set(saved.get(key, {})):
        return {p: saved[key][p] for p in prompts}
    saved[key] = ask(LanguageModel(model), prompts)
    if cache:
        cache.write_text(json.dumps(saved, indent=1))
    return saved[key]


def cells(before: dict, after: dict, replies: dict) -> dict:
    """Every cell from the base's and the adapter's answers (see the module docstring)."""
    from toygraph.demo.capitals import QUESTIONS, parse, verdict
    asked = [(p.format(c), c) for c in COUNTRIES for p in PHRASINGS]
    marks = {q: verdict(after[q], replies[c]) for q, c in asked}
    capital = {c: parse(replies[c])["capital"].lower() for c in COUNTRIES}
    known = [c for c in COUNTRIES
             if any(capital[c] in before[p.format(c)].lower() for p in PHRASINGS)]
    lost = [c for c in known if any(marks[p.format(c)] != "right" for p in PHRASINGS)]
    taken = [p for p in OFF_TASK if in_capitals_record(after[p])]
    looping = [p for p in OFF_TASK if loops(after[p]) and not loops(before[p])]
    right = sum(m == "right" for m in marks.values())
    demo3 = sum(marks[q] == "right" for q, _ in QUESTIONS)
    return dict(demo3=f"{demo3}/{len(QUESTIONS)}", held_out=f"{right}/{len(asked)}",
                kept=f"{len(known) - len(lost)}/{len(known)}", lost=lost,
                off_task=f"{len(OFF_TASK) - len(taken)}/{len(OFF_TASK)}", taken_over=taken,
                looping=looping,
                passed=(demo3 == len(QUESTIONS) and right >= HELD_OUT_BAR and not lost
                        and not taken),
                wrong=[(q, after[q]) for q, _ in asked if marks[q] != "right"])


def table_row(result: dict) -> str:
    r = result
    recipe = ", ".join(f"{k}={v}" for k, v in r["changed"].items()) or "RECIPE as shipped"
    return (f"| {recipe} | {r['steps']} | {r['seed']} | {r['dot']} | {r['base_memory']} | "
            f"{r['demo3']} | {r['held_out']} | {r['kept']}"
            f"{' (lost ' + ', '.join(r['lost']) + ')' if r['lost'] else ''} | {r['off_task']} | "
            f"{len(r.get('looping', []))} | {r['train_s']} | {'pass' if r['passed'] else 'FAIL'} |")


def parse_args(argv=None):
    from toygraph.core.frozen_base import MODES
    from toygraph.demo.capitals import RECIPE, STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=RECIPE["seed"], help="run seed (default: %(default)s)")
    ap.add_argument("--dot", choices=("int8", "f32"), action="append", default=None,
                    help="TOYGRAPH_CPU_DOT for the run; twice: ask in both modes (default: int8)")
    ap.add_argument("--dot-check", action="store_true",
                    help="train under each --dot mode and say whether the adapters are equal")
    ap.add_argument("--base-memory", choices=MODES, default="auto",
                    help="the frozen base's form, as finetune's --base-memory (default: %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one RECIPE entry (a Python literal), e.g. lr=3e-3")
    ap.add_argument("--data", action="append", default=None, metavar="PATH[:WEIGHT]",
                    help="the training files instead of the demo's DATA (repeat to mix)")
    ap.add_argument("--out", default="/tmp/toygraph-demo-recipe", help="run directory (default: %(default)s)")
    ap.add_argument("--base-answers", metavar="JSON",
                    help="file keeping the base model's answers per mode between runs")
    ap.add_argument("--results", help="markdown file to append the run's table row to")
    args = ap.parse_args(argv)
    args.dot = list(dict.fromkeys(args.dot or ["int8"]))
    return args


def train(model, data, out, steps, base_memory, recipe):
    from toygraph.training import RunConfig, run_training
    t0 = time.perf_counter()
    run_training(RunConfig(model=model, data=data, out=out, recipe="lora", steps=steps,
                           base_memory=base_memory, overwrite=True, quiet=True, **recipe))
    return round(time.perf_counter() - t0, 1)


def main(argv=None):
    args = parse_args(argv)
    # read when the engine makes a weight and when a base is realized: set before either
    os.environ["TOYGRAPH_CPU_DOT"] = args.dot[0]
    os.environ["TOYGRAPH_BASE_MEMORY"] = args.base_memory
    from toygraph.demo.capitals import QUESTIONS, RECIPE, data_files, data_path, replies_by_country
    from toygraph.inference.language_model import LanguageModel
    from toygraph.models.catalog import smollm2_path
    changed = {}
    for item in args.set:
        key, value = item.split("=", 1)
        changed[key] = ast.literal_eval(value)
    recipe = dict(RECIPE, **changed, seed=args.seed)
    data = args.data if args.data is not None else data_files()
    if args.data is not None:
        changed["data"] = " + ".join(Path(d).name for d in data)
    model = str(smollm2_path())
    if args.dot_check:
        adapters = []
        for dot in args.dot:
            os.environ["TOYGRAPH_CPU_DOT"] = dot
            out = f"{args.out}-{dot}"
            train(model, data, out, args.steps, args.base_memory, recipe)
            adapters.append((Path(out) / "adapter_model.safetensors").read_bytes())
        print(json.dumps(dict(dot=args.dot, steps=args.steps, seed=args.seed,
                              base_memory=args.base_memory,
                              same_adapter=all(a == adapters[0] for a in adapters))))
        return
    replies = replies_by_country(data_path())   # what the demo checks answers against
    prompts = [p.format(c) for c in COUNTRIES for p in PHRASINGS] + list(OFF_TASK)
    assert {q for q, _ in QUESTIONS} <= set(prompts)
    train_s = train(model, data, args.out, args.steps, args.base_memory, recipe)
    for dot in args.dot:
        os.environ["TOYGRAPH_CPU_DOT"] = dot   # both models made after: asked in this mode
        args_dot = argparse.Namespace(**{**vars(args), "dot": dot})
        before = base_answers(model, prompts, args_dot)
        after = ask(LanguageModel(model, adapter_dir=args.out), prompts)
        result = dict(steps=args.steps, seed=args.seed, dot=dot, base_memory=args.base_memory,
                      trained_under=args.dot[0], changed=changed, train_s=train_s,
                      **cells(before, after, replies),
                      base_answers={p: before[p] for p in OFF_TASK},
                      off_task_after={p: after[p] for p in OFF_TASK})
        print(json.dumps(result))
        if args.results:
            with open(args.results, "a", encoding="utf-8") as f:
                f.write(table_row(result) + "\n")


if __name__ == "__main__":
    main()
