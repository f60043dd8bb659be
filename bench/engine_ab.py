"""Two builds of the CPU engine on the demo's training step, alternating step by step.

    python bench/engine_ab.py --against HEAD~1              # 40 steps of toygraph demo's recipe
    python bench/engine_ab.py --against main --steps 80 --model other.gguf
    python bench/engine_ab.py --against HEAD~1 --generate 200 --model m.gguf --adapter runs/x

On a machine shared with other work (or a VM whose neighbours are) two runs of one build
differ by several percent, and a microbenchmark of one kernel by more: a kernel change
worth a few percent of a step cannot be seen by timing one build, then the other. Here
both are loaded into this process (two libraries: this tree's engine and the one built
from ``--against``'s sources, each with its own pool of ``--threads`` threads), and the
step's replay alternates between them from one step to the next, so both see the same
batches and the same minutes of the machine. Printed: the median time of the step's
replayed program under each build (the first two steps of each dropped), and the load
average. Each step is computed by the build that ran it, so the run's losses are either
build's alone where the change keeps the bits (as the engine's kernels must).

``--generate N`` times generation's one-token decode instead: N tokens after a chat
prompt (each next token forced, so that the count never depends on an end-of-turn token),
the decode program alternating between the builds token by token, with ``--adapter``'s
LoRA when given; with ``--rows R``, GRPO's batched sampler: a group of R completions of up
to N tokens at temperature 1, three rounds, the decode step alternating.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: The chat prompt whose decoding --generate times (adapter_decode.py's too).
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def group_generator(lm, prompt_ids, rows: int, tokens: int):
    """GRPO's batched sampler over ``lm``'s model and adapter: ``rows`` completions of
    ``prompt_ids`` (one prefill row) of up to ``tokens`` new tokens."""
    from toygraph.inference.batched import BatchedGenerator
    return BatchedGenerator(lm.model, rows=rows, prompt_len=len(prompt_ids),
                            cache_len=len(prompt_ids) + tokens, prompt_rows=1,
                            lora=lm.lora_config, adapter=lm.adapter)


def source_at(rev: str) -> str:
    """The engine's translation unit as revision ``rev`` assembles it (its own
    toygraph/cpu/engine.py's ``source()`` over its own files, in a child process)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "toygraph"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--against {rev}: {archive.stderr.decode().strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            if hasattr(tarfile, "data_filter"):   # Python 3.10.12+/3.11.4+: the safe filter
                tar.extractall(tmp, filter="data")
            else:   # git archive's own output: no links out of tmp
                tar.extractall(tmp)
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from toygraph.cpu import engine; "
             "sys.stdout.write(engine.source())"],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tmp}, cwd=tmp)
        if child.returncode != 0:
            raise SystemExit(f"--against {rev}: its engine source: {child.stderr.strip()}")
        return child.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision whose engine is B")
    ap.add_argument("--model", help="another GGUF to train (default: the demo's SmolLM2)")
    ap.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    ap.add_argument("--threads", type=int, default=2, help="each pool's threads (default 2)")
    ap.add_argument("--out", default="/tmp/toygraph-engine-ab",
                    help="run directory, replaced (default /tmp/toygraph-engine-ab)")
    ap.add_argument("--generate", type=int, metavar="N",
                    help="time N decoded tokens instead of training steps")
    ap.add_argument("--adapter", help="--generate: a LoRA adapter directory to decode with")
    ap.add_argument("--rows", type=int, default=1,
                    help="--generate: R > 1 times GRPO's batched decode of R rows")
    args = ap.parse_args(argv)

    from toygraph.cpu import engine
    from toygraph.cpu.replay import Program, kernel_index
    from toygraph.demo import capitals
    from toygraph.models.catalog import smollm2_path
    from toygraph.training import RunConfig, run_training

    builds = {"this tree": engine.load(engine.source()),
              f"--against {args.against}": engine.load(source_at(args.against))}
    for lib in builds.values():
        lib.tg_set_threads(args.threads)
    names, turn = list(builds), [0]
    seconds: dict[str, list] = {name: [] for name in names}
    biggest = [0]   # the step's program is the phase with the most nodes
    nodes: dict[tuple, tuple] = {}   # (program, build) -> its nodes with the build's indices

    def operands(program, name):
        # the builds number their kernels apart (a kernel added shifts the rest)
        key = (program, name)
        if key not in nodes:
            table = program.nodes.copy()
            table["kernel"] = [kernel_index(builds[name], k) for k in program.kernels]
            nodes[key] = (table, (table.ctypes.data,) + program._args[1:])
        return nodes[key][1]

    def run(program, timed=False):
        name = names[turn[0]]
        args_ = operands(program, name)
        t0 = time.perf_counter()
        rc = builds[name].tg_replay(*args_, None)
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"{name}: replay failed (code {rc})")
        if args.generate:   # every program; the decode's (the most runs) are kept below
            seconds[name].append((id(program), elapsed))
            turn[0] ^= 1
        elif len(program.nodes) >= biggest[0]:   # the step: the program with the most nodes
            biggest[0] = len(program.nodes)
            seconds[name].append(elapsed)
            turn[0] ^= 1

    load = os.getloadavg()
    Program.run = run
    model = args.model or str(smollm2_path())
    if args.generate:
        return generate(args, model, names, seconds, load)
    run_training(RunConfig(model=model, data=capitals.data_files(), out=args.out,
                           recipe="lora", steps=args.steps, overwrite=True, quiet=True,
                           **capitals.RECIPE), show_use=False)
    report(f"{args.steps} steps of toygraph demo's recipe on {Path(model).name}, "
           f"{args.threads} threads", "step", seconds, load)
    return 0


def report(what: str, unit: str, seconds: dict, load) -> None:
    """Each build's median (its first two times dropped) and their ratio."""
    medians = {name: float(np.median(s[2:])) for name, s in seconds.items()}
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; {what}, "
          f"alternating")
    for name, median in medians.items():
        print(f"  {name}: median {median * 1e3:.2f} ms a {unit} over {len(seconds[name]) - 2}")
    (a, b), other = medians.values(), list(medians)[1]
    print(f"  this tree / {other}: {a / b:.3f} of its time")


def generate(args, model: str, names: list, seconds: dict, load) -> int:
    from toygraph.inference.language_model import LanguageModel
    lm = LanguageModel(model, adapter_dir=args.adapter)
    ids = lm.encode_prompt(PROMPT, True)
    if args.rows > 1:
        from toygraph.inference.sampling import SamplingOptions
        gen = group_generator(lm, ids, args.rows, args.generate)
        for seed in range(3):
            gen.generate([ids] * args.rows, args.generate, SamplingOptions(temperature=1.0,
                                                                           seed=seed))
    else:
        context = list(ids)
        rows = lm.next_logits(context, len(ids) + args.generate)
        next(rows)   # the prefill
        for i in range(args.generate - 1):
            context.append(100 + i % 1000)
            next(rows)
    runs = [program for name in names for program, _ in seconds[name]]
    decode = max(set(runs), key=runs.count)
    for name in names:
        seconds[name] = [s for program, s in seconds[name] if program == decode]
    report(f"{args.generate} tokens decoded on {Path(model).name}"
           f"{f' in groups of {args.rows}' if args.rows > 1 else ''}"
           f"{' with ' + args.adapter if args.adapter else ''}, {args.threads} threads",
           "decode step", seconds, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
