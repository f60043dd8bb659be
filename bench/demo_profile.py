"""Where the demo's training step spends its time: the engine's replay timed kernel by kernel.

    python bench/demo_profile.py                  # 30 steps of toygraph demo's recipe
    python bench/demo_profile.py --steps 60 --out /tmp/profile-run

It trains ``toygraph demo``'s RunConfig (toygraph/demo/capitals.py: RECIPE and DATA) for
``--steps`` steps with every replay of the step timed per node (``Program.run(timed=True)``,
the timer ``bench_lora.py --op-profile`` uses), and prints milliseconds per step by op and
engine kernel, biggest first. The timer adds a clock read per node, so the total is a few
percent above an untimed step. The numbers mean something only on a quiet machine; the
load average is printed with them.
"""
from __future__ import annotations

import argparse
import collections
import os
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--out", default="/tmp/toygraph-demo-profile",
                        help="run directory, replaced (default /tmp/toygraph-demo-profile)")
    parser.add_argument("--top", type=int, default=25, help="rows printed (default 25)")
    args = parser.parse_args(argv)

    from toygraph.cpu.replay import Program
    from toygraph.demo import capitals
    from toygraph.models.catalog import smollm2_path
    from toygraph.training import RunConfig, run_training

    spent: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    untimed = Program.run

    def timed_run(program, timed=False):
        untimed(program, timed=True)
        for op, kernel, seconds in zip(program.ops, program.kernels, program.seconds):
            acc = spent[f"{op} ({kernel})"]
            acc[0] += seconds
            acc[1] += 1

    load = os.getloadavg()
    Program.run = timed_run
    try:
        t0 = time.perf_counter()
        run_training(RunConfig(model=str(smollm2_path()), data=capitals.data_files(),
                               out=args.out, recipe="lora", steps=args.steps, overwrite=True,
                               **capitals.RECIPE), show_use=False)
        wall = time.perf_counter() - t0
    finally:
        Program.run = untimed
    total = sum(s for s, _ in spent.values())
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; "
          f"run_training {wall:.1f} s for {args.steps} steps; the replayed kernels "
          f"{total / args.steps * 1e3:.0f} ms a step\n")
    print("| ms/step | share | nodes/step | op (engine kernel) |\n|---:|---:|---:|---|")
    for name, (s, n) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {s / args.steps * 1e3:.2f} | {100 * s / total:.1f}% | "
              f"{n // args.steps} | {name} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
