"""GRPO with a tool on a real file: Qwen2.5-Coder-0.5B learns to call a calculator.

    python bench/grpo_calculator.py [--steps 8] [--probe 8] [--json RESULT.json]
    python bench/grpo_calculator.py --evaluate RUN_DIR [--samples 3]
    (--task two-step|products, --demo sum|product|none: the problems and the
    demonstrated exchange before each; the defaults are the 2026-12-07 run's)

``two-step`` (the default): a * b + c or a * b - c on 3-digit numbers, asked in plain
words; ``products`` (runs 1-3): a * b. A 0.5B model gets them wrong alone, and right
when it calls ``calculator`` (the tools file written beside the prompts) and reads its
reply. Each prompt, held-out ones too, before and after training, starts with one
demonstrated exchange (``DEMOS``: a call, the calculator's reply, an answer quoting it):
without one the base, given the reply, calls again and never answers (runs 1-3 below).
GRPO (``--tools``) samples episodes in which a call stops sampling, runs in the tools'
own process and has its reply fed back as a tool turn; the reward is whether the episode
ends in a plain answer (not one more call) whose last number is the problem's answer
(and 0.2 for answering after a tool reply). Held-out problems (never trained on) are
answered greedily before and after, with the tool on offer both times, and once by the
base with no tool and no demonstration (the question alone):

- accuracy: the episode's last turn answers, and its last number is the answer;
- answered: episodes whose last turn is an answer, not a call;
- called: episodes that made at least one tool call;
- valid calls: calls that parsed and ran (no "error: ..." reply), of the calls made.

It prints one JSON line: those numbers before and after, the reward per step, wall time,
time per step and the peak resident memory of the process (training, sampling and both
evaluations are in it). ``--probe N`` asks the base N held-out problems and stops.

The calls are read in the ``json`` style (``--tool-call-style json``, recipes/tools.py):
shown Qwen2.5's template and the tool, this model writes each call as a bare or
```json-fenced object and never in ``<tool_call>`` tags -- 0 of 24 sampled episodes used
the tags (temperature 1, 4 held-out problems x 6 samples, 2026-12-03). Read that way its
calls are valid from the start; what it lacks is the next step: given the tool's reply
it calls the calculator again on the result instead of answering (``--probe 6``: 6/6
called, 12/12 valid calls, 0/6 answered).

Measured to the end (2-core AMD EPYC, 2026-12-04;
bench/results/grpo-calculator-epyc-2026-12-04.md): the first run learned a reward hack.
Its reward read the episode's last message, and an episode cut right after a tool reply
(two calls and their replies fill the 96 tokens) ended with the calculator's product:
training reward 0.67 -> 1.0 by step 5 while held-out accuracy stayed 0/24 greedy and 0/72
sampled at temperature 1, before and after. Episodes now end in a turn of the model's
(empty there; recipes/episodes.py), the rewards read the last assistant turn, and
``answered`` (weight 0.2) gives a group where nobody is right a preference for answering
after the reply. With the honest reward no sampled episode answered after a reply (the
base calls again: 66 of 72 sampled held-out episodes), every group's rewards were equal
and nothing trained (2 steps, grad norm 0): a run that can learn needs episodes that
sometimes answer after the reply, and a completion budget with room for the answer.

With a demonstrated exchange (2026-12-07; bench/results/grpo-calculator-epyc-2026-12-07.md)
the base answers after the reply: shown a product, it was already right on 24/24 held-out
products greedy, so the task became ``two-step`` with a sum demonstrated (greedy 18/24,
no tool 0/24). 16 steps (128 completion tokens): greedy 24/24 after; sampled at
temperature 1, 33/48 -> 47/48 right and 39/48 -> 47/48 calling; training reward 0.47 ->
1.2 (all right), 143 s a step (75-250 s with the other jobs' load), peak RSS 2.5 GiB.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import os
import platform
import random
import re
import resource
import subprocess
import time
from pathlib import Path

MODEL = "qwen2.5-coder-0.5b"
TOOLS = '''"""The calculator GRPO's episodes may call (bench/grpo_calculator.py)."""
import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. "347 * 829"
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else str(result)
'''
REWARD = '''"""GRPO's rewards for bench/grpo_calculator.py, read from the model's last turn
(never a tool's reply: an episode cut right after one ends in an empty turn of the
model's). ``correct``: that turn is a plain answer whose last number is the product.
``answered``: it is a plain answer that follows a tool reply -- a small weight beside
``correct``, so that a group in which nobody is right yet still prefers the episodes that
call and then answer over those that call again (or answer without calling: rewarding any
plain answer taught the model to stop calling, 2026-12-04). A turn that is itself a call (a JSON object,
bare or fenced: the calls ran out) has not answered, whatever numbers it holds."""
import re

_NUMBER = re.compile(r"-?\\d[\\d,]*")


def final_number(text):
    found = _NUMBER.findall(text.replace("**", ""))
    return found[-1].replace(",", "") if found else None


def is_answer(text):
    text = text.strip()
    return bool(text) and not text.startswith(("{", "```"))


def last_reply(completion):
    if not isinstance(completion, list):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def correct(completions, answer, **kw):
    last = [last_reply(c) for c in completions]
    return [float(is_answer(t) and final_number(t) == str(a)) for t, a in zip(last, answer)]


def answered(completions, **kw):
    def after_reply(c):
        return (isinstance(c, list) and len(c) >= 2 and c[-2]["role"] == "tool"
                and is_answer(last_reply(c)))
    return [float(after_reply(c)) for c in completions]
'''
#: The question's wordings and how each combines the numbers: ``products`` (runs 1-3,
#: 2026-12-04) asks a * b; ``two-step`` asks a * b + c or a * b - c, one call away when
#: the model writes the whole expression, two when it computes a * b first.
TASKS = {
    "products": (("What is {a} times {b}?", None), ("Compute {a} * {b}.", None),
                 ("Multiply {a} by {b}.", None), ("How much is {a} multiplied by {b}?", None)),
    "two-step": (("What is {a} times {b} plus {c}?", 1), ("Compute {a} * {b} - {c}.", -1),
                 ("Multiply {a} by {b}, then subtract {c}.", -1),
                 ("How much is {a} multiplied by {b}, plus {c}?", 1)),
}
TRAIN, HELD_OUT, SEED = 96, 24, 7
#: correct, answered (the REWARD file's functions)
REWARD_WEIGHTS = ("1.0", "0.2")
SETTINGS = dict(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=8, alpha=16, lr=2e-4,
                schedule="constant", warmup=0, seq_len=448, max_completion_length=128,
                max_tool_calls=2, tool_call_style="json", temperature=1.0, loss_type="dapo", val_split=0.0, seed=0,
                log_completions=10, final="last",
                # 12 rows of 448 + 96 tokens (runs 1-3): every block's activations kept
                # planned a 17.6 GiB arena (19.1 GiB peak RSS, 2026-12-04); recomputed,
                # 1.5 GiB, the same gradients bit for bit
                checkpoint_activations=True)


#: One demonstrated exchange before each question (training and held-out alike, before
#: and after): a call, the calculator's reply and a plain answer that quotes it. Its
#: numbers are in no problem. ``sum`` shows another operation than the task's, so the
#: model must still write the question's own expression (with ``product`` and the
#: ``products`` task the base was already right on 24/24 held-out, greedy); ``none``
#: leaves it out (runs 1-3, 2026-12-04).
def exchange(a: int, word: str, op: str, b: int) -> list[dict]:
    """A question on ``a`` and ``b``, the calculator's call, its reply and an answer quoting
    it: the turns of one demonstrated exchange."""
    expression = f"{a} {op} {b}"
    result = str(eval(expression))   # two literal ints and an operator of ours
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return [{"role": "user", "content": f"What is {a} {word} {b}?"},
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"{a} {word} {b} is {result}."}]


DEMOS = {"sum": exchange(218, "plus", "+", 537), "product": exchange(218, "times", "*", 537),
         "none": []}
DEMO_NUMBERS = {218, 537}   # no problem holds them


def problems(task: str = "two-step", demo: str = "sum") -> list[dict]:
    """TRAIN + HELD_OUT distinct problems of ``task`` on 3-digit numbers, each a chat
    prompt (the demonstrated exchange ``DEMOS[demo]``, then the question) with its
    answer; deterministic, and the same problems whatever the demonstration (``products``
    draws exactly as runs 1-3 did)."""
    rng, seen, rows = random.Random(SEED), set(), []
    while len(rows) < TRAIN + HELD_OUT:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        c = rng.randint(100, 999) if task != "products" else None
        if (a, b, c) in seen:
            continue
        seen.add((a, b, c))
        phrasing, sign = rng.choice(TASKS[task])
        question = phrasing.format(a=a, b=b, c=c)
        if {a, b, c} & DEMO_NUMBERS:
            continue
        answer = a * b + sign * c if sign else a * b
        rows.append({"prompt": [*DEMOS[demo], {"role": "user", "content": question}],
                     "question": question, "answer": str(answer)})
    return rows


def write_files(folder: Path, task: str = "two-step", demo: str = "sum"
                ) -> tuple[Path, Path, Path, list[dict]]:
    """The training prompts, the tools file, the reward file and the held-out rows."""
    rows = problems(task, demo)
    folder.mkdir(parents=True, exist_ok=True)
    prompts, tools, reward = (folder / n for n in ("prompts.jsonl", "tools.py", "reward.py"))
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows[:TRAIN]))
    tools.write_text(TOOLS)
    reward.write_text(REWARD)
    return prompts, tools, reward, rows[TRAIN:]


def reward_functions() -> dict:
    """The reward file's own functions (``correct``, ``answered``), so the held-out
    accuracy is read exactly as training scores it."""
    scope: dict = {}
    exec(compile(REWARD, "reward.py", "exec"), scope)
    return scope


def held_out(model: str, adapter: str | None, tools: Path, rows: list[dict],
             max_new_tokens: int, max_tool_calls: int, style: str, samples: int = 0) -> dict:
    """Episodes over ``rows`` with the calculator on offer: accuracy, calls made, valid
    calls, and the first few episodes. Greedy (``samples`` 0), or ``samples`` episodes a
    row sampled at the training temperature (episode j of row i seeded 1000 j + i, so
    before and after meet the same draws)."""
    from toygraph.inference.language_model import LanguageModel
    from toygraph.recipes.episodes import model_generate, tool_episode
    from toygraph.recipes.tools import ToolBox
    lm = LanguageModel(model, adapter_dir=adapter, seq_len=SETTINGS["seq_len"] + 64)
    box = ToolBox(str(tools))
    plain = model_generate(lm, tools=None, max_new_tokens=2 * max_new_tokens)
    reward = reward_functions()
    right = called = calls = valid = answered = 0
    shown, wrong = [], []   # the first few episodes, and the first few not right
    draws = [(i, j) for j in range(max(samples, 1)) for i in range(len(rows))]
    try:
        for i, j in draws:
            row = rows[i]
            sampling = (dict(temperature=SETTINGS["temperature"], seed=1000 * j + i)
                        if samples else {})
            generate = model_generate(lm, tools=box.schemas, max_new_tokens=max_new_tokens,
                                      **sampling)
            ep = tool_episode(generate, box, row["prompt"], style, max_tool_calls)
            turns = ep.messages[len(row["prompt"]):]   # not the demonstration's
            replies = [m["content"] for m in turns if m["role"] == "tool"]
            ok = reward["correct"]([turns], [row["answer"]])[0] == 1.0
            right += ok
            answered += reward["answered"]([turns])[0] == 1.0
            called += ep.tool_calls > 0
            calls += len(replies)
            valid += sum(not r.startswith("error:") for r in replies)
            episode = {"question": row["question"], "answer": row["answer"], "turns": turns}
            if len(shown) < 6:
                shown.append(episode)
            if not ok and len(wrong) < 8:
                wrong.append(episode)
    finally:
        box.close()
    n = len(draws)
    alone = 0 if adapter is not None or samples else sum(   # the base with no tool on offer
        reward["correct"]([[{"role": "assistant", "content": plain(
            [{"role": "user", "content": row["question"]}], ())}]],
                          [row["answer"]])[0] == 1.0 for row in rows)
    return dict(accuracy=f"{right}/{n}", answered=f"{answered}/{n}", called=f"{called}/{n}",
                valid_calls=f"{valid}/{calls}", episodes=shown, wrong=wrong,
                **({} if adapter is not None or samples else
                   {"accuracy_without_tool": f"{alone}/{n}"}))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=6)
    ap.add_argument("--probe", type=int, default=0, metavar="N",
                    help="only ask the base model N held-out problems, then stop")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one SETTINGS entry (a Python literal), e.g. lr=1e-4")
    ap.add_argument("--task", choices=sorted(TASKS), default="two-step",
                    help="the problems (default: two-step, a * b + c or a * b - c)")
    ap.add_argument("--demo", choices=sorted(DEMOS), default="sum",
                    help="the demonstrated exchange before each question (default: sum)")
    ap.add_argument("--out", default="/tmp/toygraph-grpo-calculator")
    ap.add_argument("--json", help="also write the result line here")
    ap.add_argument("--samples", type=int, default=0, metavar="N",
                    help="held-out episodes sampled at the training temperature, N a problem "
                         "(default 0: greedy, one a problem)")
    ap.add_argument("--before", metavar="RESULT.json",
                    help="take the base's held-out numbers from an earlier result line of "
                         "this script (same model, problems and decoding) instead of asking")
    ap.add_argument("--evaluate", metavar="RUN_DIR",
                    help="train nothing: the held-out numbers of the base and of RUN_DIR's "
                         "adapter (a finished run of this script)")
    args = ap.parse_args()
    from toygraph.models.catalog import resolve_model
    from toygraph.training import RunConfig, run_training
    settings = dict(SETTINGS)
    for item in args.set:
        key, value = item.split("=", 1)
        settings[key] = ast.literal_eval(value)
    model = str(resolve_model(MODEL))
    out = Path(args.out)
    prompts, tools, reward, held = write_files(out.with_name(out.name + "-data"), args.task, args.demo)
    turn_tokens = settings["max_completion_length"] // 2
    ask = dict(max_new_tokens=turn_tokens, max_tool_calls=settings["max_tool_calls"],
               style=settings["tool_call_style"])
    if args.probe:
        print(json.dumps(held_out(model, None, tools, held[:args.probe], **ask), indent=1))
        return
    if args.evaluate:
        t0 = time.perf_counter()
        before = held_out(model, None, tools, held, samples=args.samples, **ask)
        after = held_out(model, args.evaluate, tools, held, samples=args.samples, **ask)
        line = json.dumps(dict(
            date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cpu=cpu_model(), cpus=os.cpu_count(),
            model=Path(model).name, task=args.task, demo=args.demo, adapter=args.evaluate,
            samples=args.samples,
            temperature=SETTINGS["temperature"] if args.samples else 0.0,
            held_out_before={k: v for k, v in before.items() if k not in ("episodes", "wrong")},
            held_out_after={k: v for k, v in after.items() if k not in ("episodes", "wrong")},
            wall_s=round(time.perf_counter() - t0, 1),
            peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            episodes_before=before["episodes"], episodes_after=after["episodes"],
            wrong_before=before["wrong"], wrong_after=after["wrong"]))
        print(line)
        if args.json:
            Path(args.json).write_text(line + "\n")
        return
    t0 = time.perf_counter()
    if args.before:
        earlier = json.loads(Path(args.before).read_text())
        before = {**earlier["held_out_before"], "episodes": earlier["episodes_before"]}
    else:
        before = held_out(model, None, tools, held, **ask)
    t1 = time.perf_counter()
    end = run_training(RunConfig(model=model, data=str(prompts), out=str(out), recipe="grpo",
                                 reward=(f"{reward}:correct", f"{reward}:answered"),
                                 reward_weights=REWARD_WEIGHTS, tools=str(tools),
                                 steps=args.steps, batch=args.batch,
                                 num_generations=args.num_generations,
                                 overwrite=True, quiet=True, **settings))
    t2 = time.perf_counter()
    if end["status"] in ("interrupted", "failed"):   # no adapter in out/ to ask
        sys.exit(f"{out}: training {end['status']} ({end['reason']}); "
                 f"continue it with: {end.get('resume')}")
    after = held_out(model, str(out), tools, held, **ask)
    wall = time.perf_counter() - t0
    steps = [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
             if e["event"] == "step"]
    result = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cpu=cpu_model(), cpus=os.cpu_count(),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip(),
        model=Path(model).name, task=args.task, demo=args.demo, steps=args.steps,
        batch=args.batch, num_generations=args.num_generations, settings=settings,
        train_problems=TRAIN, held_out_problems=len(held),
        held_out_before={k: v for k, v in before.items() if k not in ("episodes", "wrong")},
        held_out_after={k: v for k, v in after.items() if k not in ("episodes", "wrong")},
        wall_s=round(wall, 1), training_s=round(t2 - t1, 1),
        s_per_step=round((t2 - t1) / args.steps, 1),
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        reward=[round(e["reward"], 3) for e in steps],
        tool_calls_mean=[round(e.get("tools/calls_mean", float("nan")), 2) for e in steps],
        episodes_before=before["episodes"], episodes_after=after["episodes"],
        wrong_before=before.get("wrong", []), wrong_after=after["wrong"])
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
