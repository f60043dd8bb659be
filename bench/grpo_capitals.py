"""GRPO on SmolLM2 from rewards alone: the capitals questions answered in one-line JSON.

    python bench/grpo_capitals.py --steps 30 --batch 4 --num-generations 4 [--set lr=2e-3 ...]

The prompts are capitals.jsonl's questions (toygraph/demo/capitals.jsonl) with a system
line asking for JSON (with an example about France); the data holds no reply text, only
the fields the rewards check (``country``, ``capital``). Four rewards: the reply names the
right capital anywhere (grpo_capitals_rewards.py: partial credit the base model earns at
first), it is exactly the capital or a JSON object whose ``capital`` is (``exact:``), it
is a JSON object with exactly the string keys ``country`` and ``capital``
(``json-schema:``), and it is at most 60 characters (``length:``). A held-out 3% of the questions
is answered greedily before and after training (the run's eval events: the validation
"loss" is minus the mean total reward). Prints one JSON line: the settings, the wall time,
the reward per step and the held-out rewards, and writes it to ``--json`` when given.
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

from toygraph.demo.capitals import data_path
from toygraph.models.catalog import smollm2_path
from toygraph.training import RunConfig, run_training

SYSTEM = 'You answer in JSON. Example: {"country": "France", "capital": "Paris"}'
SCHEMA = {"type": "object", "required": ["country", "capital"], "additionalProperties": False,
          "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}}
REWARDS = ("{here}/grpo_capitals_rewards.py:names_capital", "exact:capital",
           "json-schema:{schema}", "length:1:60")
SETTINGS = dict(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=16, alpha=32, lr=3e-3,
                schedule="constant", warmup=0, seq_len=64, max_completion_length=24,
                temperature=0.7, loss_type="dapo", val_split=0.03, seed=0, log_completions=3,
                reward_weights=("1", "1", "1", "0.5"))


def write_prompts(folder: Path) -> tuple[Path, Path]:
    """The prompt file (question + fields, no reply) and the schema file."""
    rows = []
    for line in data_path().read_text().splitlines():
        row = json.loads(line)
        reply = json.loads(row["response"])
        rows.append({"prompt": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": row["instruction"]}],
                     "country": reply["country"], "capital": reply["capital"]})
    folder.mkdir(parents=True, exist_ok=True)
    prompts, schema = folder / "capitals-prompts.jsonl", folder / "capitals.schema.json"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    schema.write_text(json.dumps(SCHEMA))
    return prompts, schema


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=4)
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
    prompts, schema = write_prompts(out.with_name(out.name + "-data"))
    here = Path(__file__).resolve().parent
    rewards = tuple(r.format(schema=schema, here=here) for r in REWARDS)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    run_training(RunConfig(model=str(smollm2_path()), data=str(prompts), out=str(out),
                           recipe="grpo", reward=rewards, steps=args.steps, batch=args.batch,
                           num_generations=args.num_generations, eval_every=args.steps,
                           overwrite=True, **settings))
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
        s_per_step=round(wall / args.steps, 1),
        generation_s=round(sum(e["time/generation_s"] for e in steps), 1),
        update_s=round(sum(e["time/update_s"] for e in steps), 1),
        reward=[round(e["reward"], 3) for e in steps],
        reward_by_function={r: [round(e[f"rewards/{r}/mean"], 3) for e in steps]
                            for r in rewards},
        mean_length=[round(e["completions/mean_length"], 1) for e in steps],
        held_out=[{k: e[k] for k in e if k.startswith("val_") or k in ("step", "prompts")}
                  for e in evals],
        samples=[e["sample"] for e in steps if "sample" in e])
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
