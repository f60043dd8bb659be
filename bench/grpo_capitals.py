"""GRPO on SmolLM2 from rewards alone: the capitals questions answered in one-line JSON.

    OPENBLAS_NUM_THREADS=1 python bench/grpo_capitals.py --steps 40 --batch 2 \\
        --num-generations 8 --json out.json

The prompts are capitals.jsonl's questions (toygraph/demo/capitals.jsonl) after a system
line asking for one line of JSON and one demonstrated exchange about France (France's own
questions are left out); the data holds no reply to any question asked, only the fields the
rewards check (``country``, ``capital``). Three rewards, none shaped: the reply is exactly
the capital or a JSON object whose ``capital`` is (``exact:capital``), a JSON object whose
``country`` is the one asked about (``exact:country``; without it the model learned to copy
France from the example), and a JSON object with exactly the string keys ``country`` and
``capital`` (``json-schema:``). bench/results/grpo-capitals-cpu-smollm2-2026-11-25.md has
both runs.

Every 10th country (all three of its questions) is held out of the training data and
answered greedily by the base model before and by the trained adapter after
(LanguageModel.generate, independent of the recipe's sampler), scored by the same rewards.
The run's own validation split (questions about training countries, other phrasings) is
answered greedily every ``--eval-every`` steps. Prints one JSON line: the settings, the
wall time, the reward per step, the validation curve and the held-out rewards before and
after, and writes it to ``--json`` when given.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from toygraph.demo.capitals import data_path, parse
from toygraph.inference.language_model import LanguageModel
from toygraph.models.catalog import smollm2_path
from toygraph.recipes.rewards import parse_rewards, score
from toygraph.training import RunConfig, run_training

SYSTEM = 'Answer with one line of JSON: {"country": ..., "capital": ...}.'
# One demonstrated exchange about a country left out of the data: small instruct models copy
# a shown format far more readily than they follow an instruction (a system line alone gave
# SmolLM2 sentences, never JSON). It is prompt text, not the reply to any question asked.
EXAMPLE = ("France", "What is the capital of France?", '{"country": "France", "capital": "Paris"}')
SCHEMA = {"type": "object", "required": ["country", "capital"], "additionalProperties": False,
          "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}}
REWARDS = ("exact:capital", "exact:country", "json-schema:{schema}")
HOLD_OUT_EVERY = 10     # every 10th country (sorted by name) is never trained on
SETTINGS = dict(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=8, alpha=16, lr=5e-4,
                schedule="constant", warmup=0, seq_len=76, max_completion_length=24,
                temperature=1.0, loss_type="dapo", val_split=0.05, seed=0, log_completions=10,
                final="last")


def prompt_rows() -> list[dict]:
    """One row per question: the prompt messages and the fields, no reply."""
    rows = []
    for line in data_path().read_text().splitlines():
        row = json.loads(line)
        reply = parse(row["response"])   # the demo's record; GRPO's rewards want JSON
        if reply["country"] == EXAMPLE[0]:
            continue
        rows.append({"prompt": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": EXAMPLE[1]},
                                {"role": "assistant", "content": EXAMPLE[2]},
                                {"role": "user", "content": row["instruction"]}],
                     "country": reply["country"], "capital": reply["capital"]})
    return rows


def write_prompts(folder: Path) -> tuple[Path, Path, list[dict]]:
    """The training prompt file, the schema file, and the held-out countries' rows."""
    rows = prompt_rows()
    held = set(sorted({r["country"] for r in rows})[::HOLD_OUT_EVERY])
    folder.mkdir(parents=True, exist_ok=True)
    prompts, schema = folder / "capitals-prompts.jsonl", folder / "capitals.schema.json"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows if r["country"] not in held))
    schema.write_text(json.dumps(SCHEMA))
    return prompts, schema, [r for r in rows if r["country"] in held]


def held_out_rewards(adapter, rows, rewards, max_new_tokens) -> dict:
    """Each reward's mean over greedy answers to ``rows`` (base model when adapter is None),
    and the first few answers."""
    lm = LanguageModel(str(smollm2_path()), adapter_dir=adapter, seq_len=128)
    replies = [lm.generate(r["prompt"], chat=True, max_new_tokens=max_new_tokens) for r in rows]
    completions = [[{"role": "assistant", "content": x}] for x in replies]
    fields = {k: [r[k] for r in rows] for k in ("country", "capital")}
    values = score(rewards, [r["prompt"] for r in rows], completions, fields)
    return dict({rw.name: round(float(np.nanmean(values[:, j])), 3)
                 for j, rw in enumerate(rewards)}, prompts=len(rows),
                replies=[[r["capital"], x] for r, x in zip(rows[:9], replies)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one SETTINGS entry (a Python literal), e.g. lr=3e-3")
    ap.add_argument("--out", default="/tmp/toygraph-grpo-capitals")
    ap.add_argument("--json", help="also write the result line here")
    args = ap.parse_args()
    settings = dict(SETTINGS)
    for item in args.set:
        key, value = item.split("=", 1)
        settings[key] = ast.literal_eval(value)
    out = Path(args.out)
    prompts, schema, held = write_prompts(out.with_name(out.name + "-data"))
    rewards = tuple(r.format(schema=schema) for r in REWARDS)
    scorers = parse_rewards(rewards)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    before = held_out_rewards(None, held, scorers, settings["max_completion_length"])
    t1 = time.perf_counter()
    run_training(RunConfig(model=str(smollm2_path()), data=str(prompts), out=str(out),
                           recipe="grpo", reward=rewards, steps=args.steps, batch=args.batch,
                           num_generations=args.num_generations, eval_every=args.eval_every,
                           overwrite=True, **settings))
    t2 = time.perf_counter()
    after = held_out_rewards(str(out), held, scorers, settings["max_completion_length"])
    wall = time.perf_counter() - t0
    events = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    result = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), host=platform.node(), cpus=os.cpu_count(),
        load_before=[round(x, 1) for x in load_before],
        load_after=[round(x, 1) for x in os.getloadavg()],
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip(),
        steps=args.steps, batch=args.batch, num_generations=args.num_generations,
        settings={k: v for k, v in settings.items()}, rewards=rewards, wall_s=round(wall, 1),
        training_s=round(t2 - t1, 1), s_per_step=round((t2 - t1) / args.steps, 1),
        generation_s=round(sum(e["time/generation_s"] for e in steps), 1),
        update_s=round(sum(e["time/update_s"] for e in steps), 1),
        reward=[round(e["reward"], 3) for e in steps],
        reward_by_function={r: [round(e[f"rewards/{r}/mean"], 3) for e in steps]
                            for r in rewards},
        frac_flat=[round(e.get("frac_reward_zero_std", float("nan")), 3) for e in steps],
        mean_length=[round(e["completions/mean_length"], 1) for e in steps],
        validation=[{k: e[k] for k in e if k.startswith("val_") or k in ("step", "prompts")}
                    for e in evals],
        held_out_countries=sorted({r["country"] for r in held}),
        held_out_before=before, held_out_after=after,
        samples=[e["sample"] for e in steps if "sample" in e])
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
