"""How fast each library multiplies f32 matrices here: the engine's gemm_f32, numpy's BLAS
and torch's, one square product, in one process.

    python bench/studies/gemm_speed.py [--n 2048] [--threads 2] [--runs 5]
    TOYGRAPH_CPU_TARGET=x86-64-v3 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/studies/gemm_speed.py

The question it answers: at which instruction set each one runs on this CPU (MKL, torch's
BLAS, takes its AVX2 kernels on AMD CPUs even where AVX-512 is there), so that a step
table's ratio against torch can be read for what it is. Prints GFLOP/s (2 n^3 per
product, the mean of ``--runs`` after two warm-up runs) and the engine's build.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def rate(fn, n: int, runs: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(runs):
        fn()
    return 2 * n ** 3 * runs / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    from toygraph.cpu import engine
    from toygraph.cpu.replay import REPLAYS, Program
    import toygraph.ops.replays  # noqa: F401  (the families' replays)
    engine.use_threads(args.threads)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((args.n, args.n)).astype(np.float32) for _ in range(2))
    out = np.empty((args.n, args.n), np.float32)
    call = REPLAYS["matmul"](None, out, [a, b], {"trans_a": False, "trans_b": False})
    program = Program([call], ["matmul"])
    print(f"{args.n}^3 f32, {args.threads} threads; the engine built for {engine.simd()}")
    print(f"  engine gemm_f32: {rate(program.run, args.n, args.runs):.1f} GFLOP/s")
    print(f"  numpy matmul:    {rate(lambda: np.matmul(a, b, out=out), args.n, args.runs):.1f} GFLOP/s")
    try:
        import torch
    except ImportError:
        return 0
    torch.set_num_threads(args.threads)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    print(f"  torch matmul:    {rate(lambda: ta @ tb, args.n, args.runs):.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
