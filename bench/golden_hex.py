"""Every golden experiment's per-step losses as exact float hex, on the CPU backend's numpy
kernels ("cpu"), its engine replay ("engine") and the CUDA kernels run by the host
executor ("cuda"), as JSON: two runs of this on two commits say whether a change moved any
loss by even one bit.

    python bench/golden_hex.py before.json            # all experiments
    python bench/golden_hex.py after.json lora_qv_tiny_llama dpo_qv_tiny_llama
    python bench/golden_hex.py --compare before.json after.json
    TOYGRAPH_BASE_MEMORY=quantized python bench/golden_hex.py --cpu q.json   # no CUDA

``--compare`` compares the runs both files hold and lists the ones only one holds.
SmolLM2 (lora_qv_smollm2) runs on numpy only: 135M parameters through the host executor's
fibers would take hours. Compare runs made with the same BLAS threads: OpenBLAS splits a
GEMM's sums by thread count, so ``OPENBLAS_NUM_THREADS=1`` against the default moves the
last bits of numpy's losses from the third step on (seen on this 2-core machine; the
recorded files use the default), and OpenBLAS picks its kernels by CPU model, so compare
files recorded on one machine (bench/results/README.md names each file's).
"""
from __future__ import annotations

import json
import os
import sys


#: The CPU backend's two replays: "cpu" its numpy kernels (the reference, the key older
#: files hold), "engine" the CPU engine's replay of each phase.
REPLAYS = {"cpu": "numpy", "engine": "engine"}


def record(path: str, names: list[str], backends=("cpu", "engine", "cuda")) -> None:
    os.environ.setdefault("TOYGRAPH_CUDA_DEVICE", "host")
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    out = {}
    for name in names or sorted(EXPERIMENTS):
        for backend in backends:
            if backend == "cuda" and name == "lora_qv_smollm2":
                continue
            os.environ["TOYGRAPH_CPU_REPLAY"] = REPLAYS.get(backend, "numpy")
            losses = run_experiment(EXPERIMENTS[name], "cuda" if backend == "cuda" else "cpu")
            out[f"{name}.{backend}"] = [float(x).hex() for x in losses]
            print(name, backend, out[f"{name}.{backend}"][-1], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    alone = sorted(a.keys() ^ b.keys())
    print(f"{len(a)} vs {len(b)} runs; {len(a.keys() & b.keys())} in both, {len(differ)} differ"
          f"{': ' + ', '.join(differ) if differ else ''}"
          f"{'; only in one: ' + ', '.join(alone) if alone else ''}")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if sys.argv[1:2] == ["--cpu"]:
        record(sys.argv[2], sys.argv[3:], backends=("cpu", "engine"))
    else:
        record(sys.argv[1], sys.argv[2:])
