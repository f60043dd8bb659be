"""Would the 8-bit dot kernels make training's forward products cheaper? 128 rows of x
times a weight in blocks, by the f32 panels (what a training step uses) and by the 8-bit
dot kernels of generation (x rounded per 32 columns to int8, integer multiply-adds), four
rows a call, in one process.

    python bench/studies/int8_many_rows.py [--threads 2]
    TOYGRAPH_CPU_TARGET=x86-64-v3 python bench/studies/int8_many_rows.py

Random weights quantized by block_encode at three shapes and formats. Prints each way's
time (the mean of 10 runs after 3) and GFLOP/s (2 M N K), and the ratio. The dot kernels
are built for a few rows (generation's one-token step): they decode a block per row group,
so this says whether they could be reused as they are, not what a kernel for many rows
(the weights repacked, rows held in registers) would reach.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

SHAPES = [("q4_k", (4864, 1024)), ("q8_0", (4864, 896)), ("q4_k", (2048, 2048))]


def seconds(fn, runs: int = 10) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - t0) / runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args(argv)
    from toygraph.cpu import engine
    from toygraph.gguf import block_encode
    engine.use_threads(args.threads)
    print(f"{args.rows} rows, {args.threads} threads; the engine built for {engine.simd()}")
    for fmt, (N, K) in SHAPES:
        w = (np.random.default_rng(0).standard_normal((N, K)) * 0.1).astype(np.float32)
        weight = engine.Weight(block_encode.quantize(w, fmt), fmt, (N, K))
        x = np.random.default_rng(1).standard_normal((args.rows, K)).astype(np.float32)
        out = np.empty((args.rows, N), np.float32)
        panels = seconds(lambda: weight.matmul(x, out, True, 1))
        dots = seconds(lambda: [weight.matmul(x[m:m + 4], out[m:m + 4], True, 3)
                                for m in range(0, args.rows, 4)])
        flop = 2 * args.rows * N * K / 1e9
        print(f"  {fmt} [{N}, {K}]: f32 panels {panels * 1e3:.2f} ms ({flop / panels:.0f} "
              f"GFLOP/s), 8-bit dots 4 rows a call {dots * 1e3:.2f} ms ({flop / dots:.0f}); "
              f"dots / panels {dots / panels:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
