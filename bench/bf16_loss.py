"""What --precision bf16 does to the loss on SmolLM2: the same LoRA steps on the numpy
backend (f32, the reference), and on the CUDA kernels (run by the host executor here, or
on a GPU) at f32, at bf16 with every buffer f32 and every product its own GEMM
(TOYGRAPH_CUDA_BF16_ACTIVATIONS=0 TOYGRAPH_CUDA_DUAL_GEMM=0) and at bf16 with the
activations kept in bf16 and LoRA's products in one GEMM (cuda/bf16_storage.py) -- a table of
per-step losses and their relative distance from the reference.

    python bench/bf16_loss.py --layers 2 --steps 4 --json out.json --md out.md
    TOYGRAPH_CUDA_DEVICE=0 python bench/bf16_loss.py --layers 30 --steps 20   # a GPU, whole model
    TOYGRAPH_CUDA_DEVICE=0 python bench/bf16_loss.py --gguf .gpu/smollm2-8l.gguf   # a file as is
    python bench/bf16_loss.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --runs 0,3   # two runs

The host executor runs every CUDA thread as a fiber, so here the model is a slice of
SmolLM2-135M-Instruct's first ``--layers`` blocks (bench/slice_gguf.py: the file's own
tensors, its Q4_1 weights and Q8_0 embedding as they are) with its full 49152-token head;
the data is the demo's capitals rows in SmolLM2's chat template, LoRA r16 on all seven
projections, AdamW with a cosine schedule as fixtures/experiments.py trains.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (name, backend, precision, whether bf16 activations and the dual GEMM are on)
RUNS = (("numpy f32", "cpu", "f32", True), ("cuda f32", "cuda", "f32", True),
        ("cuda bf16, f32 buffers, two GEMMs", "cuda", "bf16", False),
        ("cuda bf16, bf16 activations, dual GEMM", "cuda", "bf16", True))


def run(path: Path, backend: str, precision: str, steps: int, batch: int, seq: int,
        lr: float) -> list[float]:
    """The per-step losses of the LoRA run."""
    return trainer(path, backend, precision, steps, batch, seq, lr)[1].run()


def trainer(path: Path, backend: str, precision: str, steps: int, batch: int, seq: int,
            lr: float):
    """(the realized LoRA recipe, its Trainer over ``steps`` steps of the capitals data)."""
    from toygraph.core.optimizer import AdamWSettings, Schedule
    from toygraph.data.batches import Batch
    from toygraph.fixtures.experiments import capitals_batches
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    from toygraph.training.loop import Trainer
    model = GGUFModel(path)
    recipe = LoRA(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=16, alpha=32)
    recipe.realize(model, model.config, RecipeOptions(seq_len=seq, batch=batch, seed=5,
                                                      backend=backend, precision=precision))
    data = capitals_batches(path, batch, seq, steps, 5)
    pos = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    micro = [Batch(t, pos, lab, int((lab != -1).sum())) for t, lab in data]
    sched = Schedule(lr, "cosine", warmup=min(1, steps - 1), total=steps, floor=lr / 10)
    return recipe, Trainer(recipe, micro.__getitem__, sched, steps, adamw=AdamWSettings())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--gguf", help="a GGUF to use as it is (no slicing; its tokenizer too)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--runs", default=",".join(str(i) for i in range(len(RUNS))),
                    help="which of the runs, by index (0 numpy f32, the reference, is always run): "
                         + "; ".join(f"{i} {r[0]}" for i, r in enumerate(RUNS)))
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOYGRAPH_CUDA_DEVICE", "host")
    from slice_gguf import slice_gguf
    from toygraph.models.catalog import smollm2_path
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.gguf) if args.gguf else Path(tmp) / f"smollm2-{args.layers}l.gguf"
        if not args.gguf:
            slice_gguf(smollm2_path(), path, args.layers, quiet=True)
        picked = sorted({0} | {int(i) for i in args.runs.split(",")})
        for name, backend, precision, storage in (RUNS[i] for i in picked):
            for var in ("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "TOYGRAPH_CUDA_DUAL_GEMM"):
                os.environ[var] = "1" if storage else "0"
            t0 = time.perf_counter()
            losses = run(path, backend, precision, args.steps, args.batch, args.seq_len, args.lr)
            results[name] = {"losses": [float(x) for x in losses],
                             "seconds": round(time.perf_counter() - t0, 1)}
            print(name, results[name], flush=True)
    ref = results["numpy f32"]["losses"]
    for r in results.values():
        r["max_rel_vs_numpy_f32"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
    device = os.environ["TOYGRAPH_CUDA_DEVICE"]
    meta = {"date": _dt.date.today().isoformat(), "layers": args.layers, "steps": args.steps,
            "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
            "cuda_device": "host executor (CPU)" if device == "host" else f"GPU {device}",
            "command": "python bench/bf16_loss.py " + " ".join(argv or sys.argv[1:])}
    table = ["| run | " + " | ".join(f"step {i + 1}" for i in range(args.steps))
             + " | max rel. vs numpy f32 |",
             "|---|" + "---:|" * (args.steps + 1)]
    for name, r in results.items():
        table.append(f"| {name} | " + " | ".join(f"{x:.6f}" for x in r["losses"])
                     + f" | {r['max_rel_vs_numpy_f32']:.2e} |")
    print("\n".join(table))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    if args.md:
        Path(args.md).write_text(
            f"### --precision bf16 and the loss: "
            f"{args.gguf or f'SmolLM2-135M-Instruct, first {args.layers} blocks'}\n\n`{meta['command']}` ({meta['date']}, CUDA kernels on the "
            f"{meta['cuda_device']}; LoRA r16 on q,k,v,o,gate,up,down, {args.batch} x "
            f"{args.seq_len} tokens a step, lr {args.lr} cosine)\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
