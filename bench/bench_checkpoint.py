"""Activation checkpointing: planned memory and step time of a LoRA step with and without
``checkpoint_activations`` (toygraph/core/recompute.py), same model, data and settings.

Each variant runs in its own child process (peak memory is its own). Per variant: the
buffer plan realize made (the arena holds every intermediate: activations and backward
temporaries; pinned: weights, LoRA tensors, optimizer state, inputs), on CUDA the device
allocations (toygraph/cuda/devmem.py), then (unless ``--plan-only``) ``--warmup`` + ``--steps``
timed steps on fixed random tokens with the median step time and the losses, which must
be identical with and without checkpointing.

    python bench/bench_checkpoint.py --config smollm2-512x8 --device cpu --steps 2 --warmup 1
    python bench/bench_checkpoint.py --config llama1b-2048x4 --plan-only      # no kernels run
    python bench/bench_checkpoint.py --config llama1b-2048x4 --device cuda --json out.json

``--plan-only`` builds and plans the graph realize would run on ``--device`` (the fused
head on CUDA) without allocating or running anything, so the 1B plan fits a small CPU box.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_lora import (blas_threads, device_description, ensure_toygraph, log,  # noqa: E402
                        model_path, peak_rss_bytes, rss_bytes, version)

CONFIGS = {
    "smollm2-512x8": dict(model="smollm2", seq_len=512, batch=8),
    "llama1b-2048x4": dict(model="llama1b-random", seq_len=2048, batch=4),
    "smollm2-64x8": dict(model="smollm2", seq_len=64, batch=8),   # a quick check
}
MIB = 1 << 20


def plan_only_session():
    """A Session whose realize orders and plans the graph but hands nothing to a backend
    (the numpy backend's itemsize, f32, is the CUDA one too)."""
    from toygraph.core.session import Session

    class PlanOnly(Session):
        def __init__(self, graph, backend="cpu", **precision):
            super().__init__(graph, "cpu")
            self.backend.realize = lambda *args: None
    return PlanOnly


def matmul_flops(schedule) -> int:
    """2*m*n*k summed over the step's matmuls: the compute the recompute adds, counted."""
    total = 0
    for t in schedule:
        if t.op == "matmul":
            a = t.srcs[0]
            total += 2 * int(np.prod(t.shape)) * (a.shape[-2] if t.attrs["trans_a"] else a.shape[-1])
    return total


def child(spec: dict) -> dict:
    ensure_toygraph()
    import toygraph.recipes.base as recipe_base
    from toygraph.models.model import GGUFModel
    from toygraph.core.optimizer import hp_row
    from toygraph.recipes import LoRA, RecipeOptions

    if spec["plan_only"]:
        recipe_base.Session = plan_only_session()
    model = GGUFModel(spec["gguf"])
    recipe = LoRA(targets=tuple(spec["targets"]), rank=spec["rank"], alpha=spec["alpha"])
    opts = RecipeOptions(seq_len=spec["seq"], batch=spec["batch"], seed=0, backend=spec["device"],
                         checkpoint_activations=spec["checkpoint"])
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    recipe.realize(model, model.config, opts)
    sess = recipe.sess
    out = {"realize_s": time.perf_counter() - t0, "arena_bytes": sess.plan.arena_bytes,
           "pinned_bytes": sess.plan.pinned_bytes, "nodes": len(sess.schedules["step"]),
           "matmul_flops": matmul_flops(sess.schedules["step"])}
    if spec["device"] == "cuda":
        from toygraph.cuda.devmem import plan_device_memory
        outputs = [t for ts in recipe.graph.outputs.values() for t in ts]
        mem = plan_device_memory(sess.schedules["step"], sess.plan, sess.pinned, outputs)
        out["device_resident_bytes"] = mem.resident_bytes
    if spec["plan_only"]:
        return out
    rng = np.random.default_rng(1)
    n, B, T = spec["warmup"] + spec["steps"], spec["batch"], spec["seq"]
    ids = rng.integers(0, model.config.n_vocab, size=(n, 1, B, T), dtype=np.int32)
    labels = np.concatenate([ids[..., 1:], np.full((n, 1, B, 1), -1, np.int32)], axis=-1)
    pos = np.tile(np.arange(T, dtype=np.int32), (1, B, 1))
    losses, step_s, cpu_s = [], [], []
    for i in range(n):
        ts, cs = time.perf_counter(), time.process_time()
        losses.append(recipe.step(ids[i], pos, labels[i], hp_row(i + 1, 1e-3), is_first=i == 0))
        step_s.append(time.perf_counter() - ts)
        cpu_s.append(time.process_time() - cs)
        log(f"checkpoint={spec['checkpoint']} step {i + 1}/{n}: loss {losses[-1]:.6f} "
            f"{step_s[-1]:.2f} s wall, {cpu_s[-1]:.2f} s CPU")
    w = spec["warmup"]
    out.update(losses=losses, step_s=step_s[w:], cpu_s=cpu_s[w:],
               step_ms=1e3 * statistics.median(step_s[w:]),
               cpu_ms=1e3 * statistics.median(cpu_s[w:]))
    if spec["device"] == "cpu":
        out["peak_rss_bytes"] = peak_rss_bytes() - rss0
    return out


def run_child(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([sys.executable, __file__, "--child", str(spec_path), str(out_path)],
                       check=True)
        return json.loads(out_path.read_text())


def render(a, rows: dict, argv, load: tuple, device: str, gguf: Path, note: str | None) -> str:
    off, on = rows[False], rows[True]
    timed = "step_ms" in off
    lines = [f"### Activation checkpointing, LoRA step: `{a.config}` on {device}", "",
             f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC; toygraph "
             f"{version('toygraph')}, numpy {version('numpy')}; threads: "
             f"{blas_threads() if a.device == 'cpu' else '-'}",
             f"- command: `python bench/bench_checkpoint.py {shlex.join(argv)}`",
             f"- model: `{gguf.name}`" + (f" ({note})" if note else ""),
             f"- step: batch {a.batch} x seq {a.seq}; LoRA {','.join(a.targets)} r={a.rank} "
             f"alpha={a.alpha}; " + (f"{a.warmup} warm-up + {a.steps} timed steps, median"
                                     if timed else "plan only (nothing allocated or run)"),
             f"- load average (1/5/15 min) at start: {load[0]}; at end: {load[1]}"]
    lines += [f"- note: {a.note}"] if a.note else []
    lines += ["",
             "| checkpointing | arena MiB | pinned MiB | planned total MiB |"
             + (" device resident MiB |" if a.device == "cuda" else "")
             + (" step ms (median) | CPU ms (median) | tokens/s | peak RSS MiB | loss step 1 |"
                " loss last |" if timed else ""),
             "|---|---:|---:|---:|" + ("---:|" if a.device == "cuda" else "")
             + ("---:|---:|---:|---:|---:|---:|" if timed else "")]
    for ck, r in ((False, off), (True, on)):
        line = (f"| {'on' if ck else 'off'} | {r['arena_bytes'] / MIB:.1f} | "
                f"{r['pinned_bytes'] / MIB:.1f} | {(r['arena_bytes'] + r['pinned_bytes']) / MIB:.1f} |")
        if a.device == "cuda":
            line += f" {r['device_resident_bytes'] / MIB:.1f} |"
        if timed:
            rss = r.get("peak_rss_bytes")
            line += (f" {r['step_ms']:.0f} | {r['cpu_ms']:.0f} | "
                     f"{a.batch * a.seq / r['step_ms'] * 1e3:.0f} | "
                     f"{'n/a' if rss is None else f'{rss / MIB:.0f}'} | {r['losses'][0]:.6f} | "
                     f"{r['losses'][-1]:.6f} |")
        lines.append(line)
    lines += ["", f"- matmul FLOPs per step: {off['matmul_flops'] / 1e9:.1f} G off, "
                  f"{on['matmul_flops'] / 1e9:.1f} G on ({100 * (on['matmul_flops'] / off['matmul_flops'] - 1):+.1f}%)",
              f"- arena (activations and backward temporaries): "
                  f"{off['arena_bytes'] / on['arena_bytes']:.2f}x smaller with checkpointing; "
                  f"planned total {(off['arena_bytes'] + off['pinned_bytes']) / (on['arena_bytes'] + on['pinned_bytes']):.2f}x"]
    if timed:
        lines.append(f"- step time with checkpointing: {100 * (on['step_ms'] / off['step_ms'] - 1):+.0f}% "
                     f"wall, {100 * (on['cpu_ms'] / off['cpu_ms'] - 1):+.0f}% process CPU time "
                     f"(user + system, all threads: steadier than wall time on a shared machine); "
                     f"losses identical: {on['losses'] == off['losses']}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm2-512x8", choices=sorted(CONFIGS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--wtype", default="f16", help="weight type of a generated random GGUF")
    ap.add_argument("--random-fallback", type=int, choices=[0, 1], default=1,
                    help="1: random SmolLM2-shaped weights when the GGUF is not on this "
                         "machine (as bench_lora.py); 0: download it")
    ap.add_argument("--note", help="a line for the header (e.g. machine load)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    a.targets = tuple(a.targets.split(","))
    a.seq, a.batch = CONFIGS[a.config]["seq_len"], CONFIGS[a.config]["batch"]
    a.model_note = None
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        Path(argv[2]).write_text(json.dumps(child(json.loads(Path(argv[1]).read_text()))))
        return 0
    a = parse_args(argv)
    ensure_toygraph()
    gguf = model_path(CONFIGS[a.config]["model"], a.wtype, a)
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = {}
    for ck in (False, True):
        log(f"{a.config}: checkpointing {'on' if ck else 'off'}")
        rows[ck] = run_child(dict(gguf=str(gguf), device=a.device, seq=a.seq, batch=a.batch,
                                  targets=a.targets, rank=a.rank, alpha=a.alpha,
                                  checkpoint=ck, plan_only=a.plan_only, steps=a.steps,
                                  warmup=a.warmup))
    load1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    device = (f"the CUDA backend's graph, planned on this machine ({device_description('cpu', [])}; "
              "no GPU used)" if a.plan_only and a.device == "cuda"
              else device_description(a.device, []))
    print(render(a, rows, argv, (load0, load1), device, gguf, a.model_note))
    if a.json:  # rows as bench_lora.py writes them, so gpu_session.sh reads both alike
        out = [{"impl": f"toygraph (checkpointing {'on' if ck else 'off'})", "dtype": "f32",
                "checkpointing": ck, **r,
                **({"tokens_per_s": a.batch * a.seq / r["step_ms"] * 1e3} if "step_ms" in r else {})}
               for ck, r in rows.items()]
        Path(a.json).write_text(json.dumps({"config": a.config, "device": a.device, "argv": argv,
                                            "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
