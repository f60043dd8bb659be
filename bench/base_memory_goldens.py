"""Every golden experiment with the frozen base decoded to f32 and kept quantized: the
losses must be the same floats, bit for bit (compared as float hex), in one process.

    python bench/base_memory_goldens.py [names...]

Prints one line per experiment and a summary; exit status 1 when any loss differs. The
golden files themselves are checked by ``toygraph gate`` (within their tolerance); this
is the stricter check that the quantized path changes no bit of today's results.
"""
from __future__ import annotations

import os
import sys
import time


def losses(name: str, mode: str) -> list[float]:
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    os.environ["TOYGRAPH_BASE_MEMORY"] = mode
    try:
        return [float(x) for x in run_experiment(EXPERIMENTS[name], "cpu")]
    finally:
        os.environ.pop("TOYGRAPH_BASE_MEMORY", None)


def main(argv=None) -> int:
    from toygraph.fixtures.experiments import EXPERIMENTS
    names = (argv if argv is not None else sys.argv[1:]) or sorted(EXPERIMENTS)
    bad = 0
    for name in names:
        t0 = time.perf_counter()
        ref, got = losses(name, "decode"), losses(name, "quantized")
        same = len(ref) == len(got) and all(a.hex() == b.hex() for a, b in zip(ref, got))
        bad += not same
        print(f"{'SAME' if same else 'DIFF'} {name}: {len(ref)} steps, first "
              f"{ref[0].hex()} / {got[0].hex()}, last {ref[-1].hex()} / {got[-1].hex()} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{len(names) - bad} of {len(names)} experiments bit-identical "
          "(decode vs quantized)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
