"""One-rank NCCL inside the captured CUDA graph (bench/gpu_session.sh's ``nccl`` stage).

    python bench/nccl_check.py OUT.json [EXPERIMENT ...]      (default: lora_qv_tiny_llama)

Runs each tiny experiment with the data-parallel ``all_reduce`` node in its graph
(``RecipeOptions(data_parallel=True)`` in a job of one rank, no launcher) on the GPU
backend, with CUDA graph replay on and off, and compares the losses with the same
experiment on the CPU without the node (1e-4 relative, the backends' usual tolerance) and
replay on vs off (identical). Says whether every phase was captured as a graph (an NCCL
call that cannot be captured shows up as a fallback to eager launches). ``GS_BACKEND=cpu``
is a dry run of the plumbing (the numpy kernel of the node instead of NCCL).
"""
import dataclasses
import json
import os
import sys
import time
import traceback

import numpy as np

from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment

out, names = sys.argv[1], sys.argv[2:] or ["lora_qv_tiny_llama"]
backend, RTOL = os.environ.get("GS_BACKEND", "cuda"), 1e-4


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float((np.abs(a - b) / np.maximum(np.abs(b), 1e-12)).max())


def run(exp, graphs: bool):
    os.environ["TOYGRAPH_CUDA_GRAPHS"] = "1" if graphs else "0"
    dp = dataclasses.replace(exp, options={**exp.options, "data_parallel": True})
    losses, recipe, _ = run_experiment(dp, backend=backend, return_recipe=True)
    assert any(t.op == "all_reduce" for t in recipe.graph.nodes), "no all_reduce node"
    captured = [g is not None for g in getattr(recipe.sess.backend, "_graphs", {}).values()]
    return [float(x) for x in losses], captured


results, ok_all = {"backend": backend}, True
for name in names:
    try:
        exp = EXPERIMENTS[name]
        t0 = time.perf_counter()
        cpu = [float(x) for x in run_experiment(exp, backend="cpu")]
        gpu, captured = run(exp, graphs=True)
        eager, _ = run(exp, graphs=False)
        ok = rel(gpu, cpu) <= RTOL and gpu == eager and (backend == "cpu" or all(captured))
        results[name] = {"cpu": cpu, "gpu_nccl": gpu, "gpu_nccl_eager": eager,
                         "rel": rel(gpu, cpu), "replay_identical": gpu == eager,
                         "phases_captured": captured, "ok": ok,
                         "seconds": round(time.perf_counter() - t0, 2)}
        print(f"{'PASS' if ok else 'FAIL'} {name} with a one-rank all_reduce: max rel vs cpu "
              f"{rel(gpu, cpu):.2e}; replay on/off identical {gpu == eager}; phases captured "
              f"{captured}", flush=True)
    except Exception:
        results[name] = {"error": traceback.format_exc()}
        print(results[name]["error"], file=sys.stderr)
        print(f"FAIL {name}: {results[name]['error'].strip().splitlines()[-1]}", flush=True)
        ok = False
    ok_all &= ok
json.dump(results, open(out, "w"), indent=1)
sys.exit(0 if ok_all else 1)
