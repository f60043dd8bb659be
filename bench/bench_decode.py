"""Decode speed per block format: the C decoders (toygraph/gguf/decode.cpp, every CPU of
this process) against the numpy ones (blocks.dequantize, one core), in ns per element,
on one 8192 x 2048 matrix (a Llama-1B FFN weight), values checked equal.

    python bench/bench_decode.py [--md OUT.md]
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_lora import device_description, ensure_toygraph  # noqa: E402

SHAPE = (8192, 2048)


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    ensure_toygraph()
    from toygraph.gguf import block_encode, blocks, decode
    x = (np.random.default_rng(0).standard_normal(SHAPE) * 0.02).astype(np.float32)
    out = np.empty(SHAPE, np.float32)
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = [f"### Block decode speed, {SHAPE[0]} x {SHAPE[1]} — {device_description('cpu', [])}",
             "", f"- python {platform.python_version()}, numpy {np.__version__}; C on "
             f"{decode.threads()} threads, numpy on one; best of {a.repeat}",
             f"- uptime at start: `{up}`", "",
             "| format | C ns/element | numpy ns/element | numpy / C | equal |",
             "|---|---:|---:|---:|---|"]
    for qtype in decode.FORMATS:
        raw = block_encode.quantize(x, qtype)
        c = best_of(lambda: decode.dequantize_into(raw, qtype, SHAPE, out), a.repeat)
        ref = blocks.dequantize(raw, qtype, SHAPE)
        n = best_of(lambda: blocks.dequantize(raw, qtype, SHAPE), max(1, a.repeat // 2))
        same = np.array_equal(ref.view(np.uint32), out.view(np.uint32))
        lines.append(f"| {qtype} | {c / x.size * 1e9:.3f} | {n / x.size * 1e9:.2f} | "
                     f"{n / c:.1f}x | {'yes' if same else 'NO'} |")
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines += ["", f"- uptime at end: `{up}`"]
    text = "\n".join(lines)
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
