"""How well a demo recipe teaches capitals.jsonl: train it, then ask 36 held-out questions.

    python bench/demo_recipe.py --steps 200 --seed 0 [--set lr=3e-3 --set batch=2 ...]

Trains `toygraph demo`'s LoRA recipe (toygraph.demo.capitals.RECIPE, overridden by --set) on the
shipped capitals.jsonl, then asks 12 countries the data teaches in 3 phrasings each, none
of them in the data (the demo's own three questions among them), and prints one JSON line:
the training seconds, seconds per step, how many answers are exactly the one-line JSON the
data teaches, whether the demo's three are, and every wrong answer. This is how the demo's
step count was chosen (toygraph/demo/capitals.py, RECIPE's comment).
"""
from __future__ import annotations

import argparse
import ast
import json
import time

from toygraph.demo.capitals import (QUESTIONS, RECIPE, STEPS, data_path, replies_by_country,
                           taught_answers, verdict)
from toygraph.models.catalog import smollm2_path
from toygraph.inference.language_model import LanguageModel
from toygraph.training import RunConfig, run_training

PHRASINGS = ("Tell me the capital of {}.", "What's the capital city of {}?", "Capital of {}?")
COUNTRIES = ("Japan", "Kenya", "Norway", "Peru", "Vietnam", "Morocco", "Canada", "Chile",
             "Finland", "Nigeria", "Mongolia", "Portugal")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=RECIPE["seed"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one RECIPE entry (a Python literal), e.g. lr=3e-3")
    ap.add_argument("--out", default="/tmp/toygraph-demo-recipe")
    args = ap.parse_args()
    recipe = dict(RECIPE, seed=args.seed)
    for item in args.set:
        key, value = item.split("=", 1)
        recipe[key] = ast.literal_eval(value)
    data, model = data_path(), str(smollm2_path())
    replies = replies_by_country(data)
    taught_answers(data)  # the demo's own countries must be taught
    t0 = time.perf_counter()
    run_training(RunConfig(model=model, data=str(data), out=args.out, recipe="lora",
                             steps=args.steps, overwrite=True, quiet=True, **recipe))
    train_s = time.perf_counter() - t0
    tuned = LanguageModel(model, adapter_dir=args.out)
    asked = [(p.format(c), c) for c in COUNTRIES for p in PHRASINGS]
    marks = []
    for question, country in asked:
        answer = tuned.generate(question, chat=True, max_new_tokens=24)
        marks.append((question, answer, verdict(answer, replies[country])))
    demo = {q for q, _ in QUESTIONS}
    print(json.dumps(dict(
        steps=args.steps, recipe=recipe, train_s=round(train_s, 1),
        s_per_step=round(train_s / args.steps, 2),
        right=f"{sum(m == 'right' for *_, m in marks)}/{len(marks)}",
        demo_questions_right=all(m == "right" for q, _, m in marks if q in demo),
        wrong=[(q, a) for q, a, m in marks if m != "right"])))


if __name__ == "__main__":
    main()
