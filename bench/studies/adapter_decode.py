"""What decoding with a LoRA adapter costs over the base model, by engine kernel.

    python bench/studies/adapter_decode.py --model qwen2.5-coder-1.5b --adapter runs/typed-functions
    python bench/studies/adapter_decode.py --model qwen2.5-coder-1.5b --adapter runs/typed-functions --rows 4

The base and base + adapter each decode ``--tokens`` forced tokens after a chat prompt
(forced, so that an end-of-turn token never shortens the count), in one process, one after
the other; printed: each one's milliseconds a token (the decode calls' wall time) and the
engine's time by kernel over those tokens (``Program.run`` timed). ``--rows N`` times
GRPO's batched sampler instead (a group of N completions of the prompt at temperature 1,
three rounds of ``--tokens``): the median decode step of the N rows. The question it
answered: why the worked example's adapter (q..down, rank 16) made a token 1.30x as slow
(its x A^T on one thread, its s u B^T in hundreds of tiny tasks, q/k/v's shared call lost:
`bench/results/coder-example-qwen2.5-coder-1.5b-epyc-2026-12-07.md`).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_ab import PROMPT, group_generator  # noqa: E402


def decode_profile(lm, tokens: int, warmup: int = 8):
    """(ms a token, {(op, kernel): [seconds, calls]}) over ``tokens`` decoded tokens."""
    from toygraph.cpu.replay import Program
    ids = lm.encode_prompt(PROMPT, True)
    context = list(ids)
    rows = lm.next_logits(context, len(ids) + warmup + tokens + 1)
    next(rows)   # the prefill
    for i in range(warmup):
        context.append(100 + i)
        next(rows)
    spent, plain = defaultdict(lambda: [0.0, 0]), Program.run

    def timed(program, timed=False):
        plain(program, timed=True)
        for op, kernel, s in zip(program.ops, program.kernels, program.seconds):
            spent[(op, kernel)][0] += s
            spent[(op, kernel)][1] += 1

    Program.run = timed
    try:
        t0 = time.perf_counter()
        for i in range(tokens):
            context.append(200 + i)
            next(rows)
        wall = (time.perf_counter() - t0) / tokens
    finally:
        Program.run = plain
    return 1e3 * wall, spent


def rollout_step(lm, rows: int, tokens: int) -> tuple[float, int]:
    """(the median ms of a batched decode step of ``rows`` rows, the steps timed)."""
    from toygraph.cpu.replay import Program
    from toygraph.inference.sampling import SamplingOptions
    prompt = lm.encode_prompt(PROMPT, True)
    gen = group_generator(lm, prompt, rows, tokens)
    gen.generate([prompt] * rows, tokens, SamplingOptions(temperature=1.0, seed=0))   # warm
    times, plain = {}, Program.run

    def timed(program, timed=False):
        t0 = time.perf_counter()
        plain(program)
        times.setdefault(id(program), []).append(time.perf_counter() - t0)

    Program.run = timed
    try:
        for seed in range(1, 4):
            gen.generate([prompt] * rows, tokens, SamplingOptions(temperature=1.0, seed=seed))
    finally:
        Program.run = plain
    decode = max(times.values(), key=len)   # the step run most: the decode
    return 1e3 * float(np.median(decode)), len(decode)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf path or a catalog name")
    ap.add_argument("--adapter", required=True, help="a PEFT adapter directory")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="N > 1: GRPO's batched decode of N rows")
    args = ap.parse_args(argv)
    from toygraph.cpu import engine
    from toygraph.inference.language_model import LanguageModel
    from toygraph.models.catalog import resolve_model
    engine.use_threads(args.threads)
    path = resolve_model(args.model)
    for adapter in (None, args.adapter):
        lm = LanguageModel(path, adapter_dir=adapter) if adapter else LanguageModel(path)
        if args.rows > 1:
            ms, n = rollout_step(lm, args.rows, args.tokens)
            print(f"{'base + ' + adapter if adapter else 'base'}: {ms:.1f} ms a decode step of "
                  f"{args.rows} rows (median of {n})")
            continue
        ms, spent = decode_profile(lm, args.tokens)
        print(f"{'base + ' + adapter if adapter else 'base'}: {ms:.1f} ms a token")
        for (op, kernel), (s, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:8]:
            print(f"  {op} ({kernel}): {1e3 * s / args.tokens:.2f} ms a token, "
                  f"{calls // args.tokens} calls")
        del lm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
