"""What --precision bf16 does to the gradients on SmolLM2: one LoRA step's loss and the
adapters' gradients (AdamW's first moment after step 1, 0.1 x the clipped gradient) on
the CUDA kernels against the numpy backend in f32, normwise over all adapters, the worst
tensor, and the share of elements whose sign differs -- the ones AdamW's first updates
turn into a whole +-lr step each, which is why losses after a few updates part by more
than the forward's rounding (bench/bf16_loss.py).

    python bench/studies/bf16_grads.py --layers 4 --md out.md
    python bench/studies/bf16_grads.py --layers 4 --variants plain,all,noglu   # bf16 storage per op off

Variants: ``f32`` the kernels at f32; ``plain`` bf16 matmuls with every buffer f32 and
two GEMMs (TOYGRAPH_CUDA_BF16_ACTIVATIONS=0, TOYGRAPH_CUDA_DUAL_GEMM=0); ``all`` bf16
activations and the dual GEMM; ``noattn`` / ``nonorm`` / ``noglu`` all but that op
family's bf16 reads; ``bf16adds`` all, with matmul_add also reading its add in bf16 (sums
of gradient contributions rounded at every partial sum). The CUDA kernels run on the host executor here (a slice of the model,
bench/slice_gguf.py, as bench/bf16_loss.py takes it).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/: bf16_loss, slice_gguf

#: variant -> {op: the bf16_reads it keeps}
READS = {"noattn": {"attention": (), "attention_back": ()},
         "nonorm": {"rms_norm": (), "rms_norm_back": ()},
         "noglu": {"glu": (), "glu_back": ()},
         "bf16adds": {"matmul_add": (0, 1, 2)}}


def first_step(path: Path, backend: str, precision: str, seq: int, batch: int):
    """(loss of step 1, {adapter: AdamW's m after step 1}) of bf16_loss.py's LoRA run."""
    from bf16_loss import trainer
    recipe, train = trainer(path, backend, precision, 1, batch, seq, 2e-3)
    loss = train.run()[0]
    return loss, {k: v for k, v in recipe.optimizer_state().items() if k.startswith("adam_m.")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", default="f32,plain,all")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOYGRAPH_CUDA_DEVICE", "host")
    import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
    from slice_gguf import slice_gguf
    from toygraph.ops.lowering.registry import REGISTRY
    from toygraph.models.catalog import smollm2_path
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"smollm2-{args.layers}l.gguf"
        slice_gguf(smollm2_path(), path, args.layers, quiet=True)
        loss0, ref = first_step(path, "cpu", "f32", args.seq_len, args.batch)
        keys = sorted(k for k in ref if np.any(ref[k]))
        R = np.concatenate([ref[k].ravel() for k in keys]).astype(np.float64)
        original = dict(REGISTRY)
        for v in args.variants.split(","):
            REGISTRY.clear()
            REGISTRY.update(original)
            os.environ["TOYGRAPH_CUDA_BF16_ACTIVATIONS"] = "0" if v == "plain" else "1"
            os.environ["TOYGRAPH_CUDA_DUAL_GEMM"] = "0" if v == "plain" else "1"
            for op, reads in READS.get(v, {}).items():
                REGISTRY[op] = replace(REGISTRY[op], bf16_reads=reads)
            loss, got = first_step(path, "cuda", "f32" if v == "f32" else "bf16",
                                   args.seq_len, args.batch)
            G = np.concatenate([got[k].ravel() for k in keys]).astype(np.float64)
            worst = max(np.linalg.norm(got[k] - ref[k]) / np.linalg.norm(ref[k]) for k in keys)
            rows.append((v, abs(loss - loss0) / abs(loss0), np.linalg.norm(G - R) / np.linalg.norm(R),
                         worst, float(np.mean(np.sign(G) != np.sign(R)))))
            print(rows[-1], flush=True)
        REGISTRY.clear()
        REGISTRY.update(original)
    cmd = "python bench/studies/bf16_grads.py " + " ".join(argv or sys.argv[1:])
    table = ["| variant | step-1 loss, rel. | gradients, normwise rel. | worst adapter tensor | "
             "sign differs |", "|---|---:|---:|---:|---:|"]
    table += [f"| {v} | {a:.1e} | {b:.2e} | {c:.2e} | {d:.2%} |" for v, a, b, c, d in rows]
    print("\n".join(table))
    if args.md:
        Path(args.md).write_text(
            f"### --precision bf16 and the gradients: SmolLM2-135M-Instruct, first {args.layers} "
            f"blocks\n\n`{cmd}` ({_dt.date.today().isoformat()}, CUDA kernels on the host "
            f"executor (CPU); reference numpy f32, step-1 loss {loss0:.6f}; LoRA r16 on "
            f"q,k,v,o,gate,up,down, {args.batch} x {args.seq_len} tokens; gradients as "
            f"AdamW's first moment after step 1, over the {len(keys)} adapter tensors with a "
            f"nonzero gradient)\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
