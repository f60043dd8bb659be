"""Data parallelism on the CPU: LoRA step time on 1 vs N MPI ranks at one global batch, with
the all-reduce's share of the step and the bytes it reduces.

    python bench/bench_mpi.py --ranks 1,2 --batch 8 --seq 64 --steps 5 --warmup 2 \\
        --md bench/results/cpu-mpi-<date>.md

The parent starts ``mpiexec -n N python bench/bench_mpi.py --child ...`` for each N (N = 1
is the plain single process: no launcher variables say more than one rank, so no MPI and
no all_reduce node). Each child realizes LoRA (q, v; rank 8) on SmolLM2-135M (random token
batches, fixed seed) with ``--batch`` as the global batch, ``--batch / N`` rows per rank,
and times every step. Per step it reports: the wall time (rank 0; every rank waits for the
slowest in the all-reduce, so this is the job's step time), the time spent inside the
gradient all-reduce (``World.sum_arrays``, which includes waiting for the other rank) and,
measured apart after a barrier, the time of an Allreduce of the same bytes alone (the
transfer itself). Bytes reduced = every gradient and the token count, f32.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def child(args):
    from toygraph import distributed
    from toygraph.data.batches import Batch
    from toygraph.models.catalog import smollm2_path
    from toygraph.models.model import GGUFModel
    from toygraph.core.optimizer import Schedule
    from toygraph.recipes import RecipeOptions
    from toygraph.recipes.lora import LoRA
    from toygraph.training.loop import Trainer

    w = distributed.world()
    spent = []
    if w.size > 1:  # the bench's own instrument around the collective
        inner = w.sum_arrays

        def timed(arrays, what):
            t0 = time.perf_counter()
            inner(arrays, what)
            spent.append(time.perf_counter() - t0)
        w.sum_arrays = timed
    model = GGUFModel(str(smollm2_path()))
    recipe = LoRA(targets=("q", "v"), rank=8, alpha=16)
    t0 = time.perf_counter()
    opts = RecipeOptions(seq_len=args.seq, batch=args.batch // w.size, seed=0,
                         data_parallel=w.size > 1)
    recipe.realize(model, model.config, opts)
    realize_s = time.perf_counter() - t0
    node = next((t for t in recipe.graph.nodes if t.op == "all_reduce"), None)
    n_bytes = sum(s.size for s in node.srcs) * 4 if node is not None else 0
    rng = np.random.default_rng(0)
    pos = np.tile(np.arange(args.seq, dtype=np.int32), (args.batch, 1))

    def micro(m):
        toks = rng.integers(0, model.config.n_vocab, (args.batch, args.seq), dtype=np.int32)
        return Batch(toks, pos, np.roll(toks, -1, axis=1), args.batch * args.seq)
    trainer = Trainer(recipe, micro, Schedule(1e-3), args.steps + args.warmup,
                      rank=w.rank, ranks=w.size)
    walls, losses = [], []
    for _ in range(args.steps + args.warmup):
        t0 = time.perf_counter()
        losses.append(trainer.step()[0])
        walls.append(time.perf_counter() - t0)
    alone = []
    if w.size > 1:  # the transfer alone: the same bytes after a barrier, no skew
        buf = np.ones(n_bytes // 4, np.float32)
        for _ in range(args.steps):
            w.comm.Barrier()
            t0 = time.perf_counter()
            w.comm.Allreduce(w.MPI.IN_PLACE, buf, op=w.MPI.SUM)
            alone.append(time.perf_counter() - t0)
    if w.rank == 0:
        k = args.warmup
        Path(args.json).write_text(json.dumps({
            "ranks": w.size, "rows_per_rank": args.batch // w.size, "realize_s": realize_s,
            "step_s": walls[k:], "allreduce_s": spent[k:], "allreduce_alone_s": alone,
            "bytes_reduced": n_bytes, "losses": losses}))


def row(d: dict) -> str:
    med = statistics.median
    step = med(d["step_s"])
    ar = med(d["allreduce_s"]) if d["allreduce_s"] else 0.0
    alone = med(d["allreduce_alone_s"]) if d["allreduce_alone_s"] else 0.0
    return (f"| {d['ranks']} | {d['rows_per_rank']} | {step:.3f} | {min(d['step_s']):.3f} | "
            f"{ar * 1e3:.2f} | {100 * ar / step:.2f}% | {alone * 1e3:.3f} | "
            f"{d['bytes_reduced']:,} | {d['losses'][-1]:.6f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--md", help="also write the table here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.ranks.split(",")):
            out = Path(tmp) / f"{n}.json"
            cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--child", "--json", str(out),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            print("$", " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
            results.append(json.loads(out.read_text()))
    load = os.getloadavg()
    lines = [f"# Data parallel on the CPU: SmolLM2-135M LoRA (q, v; rank 8), global batch "
             f"{args.batch} x {args.seq} tokens",
             "",
             f"- date (UTC): {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M}; machine: "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) when the table was "
             f"written: a shared machine, other processes competed for the cores",
             f"- command: `python bench/bench_mpi.py --ranks {args.ranks} --batch {args.batch} "
             f"--seq {args.seq} --steps {args.steps} --warmup {args.warmup}`; "
             f"{args.steps} timed steps after {args.warmup} warm-up steps, medians",
             "- all-reduce: time inside the gradient all-reduce per step (includes waiting for "
             "the slower rank); alone: an Allreduce of the same bytes after a barrier",
             "",
             "| ranks | rows/rank | step s (median) | step s (min) | all-reduce ms | "
             "share of step | alone ms | bytes reduced | last loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [row(d) for d in results]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)
        Path(args.md).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
