"""QLoRA on the CPU: a LoRA step with the frozen base decoded to f32 at realize ("decode")
against the base kept in its block format and decoded just in time ("quantized",
toygraph/core/frozen_base.py): peak RSS, tokens/s, the decode share of the step, and
whether the losses are the same floats.

Each (weight type, mode) runs in its own child process (its peak RSS is its own) on a
random Llama-shaped GGUF (bench/random_model.py, written once into the bench cache), with
the same seeded adapter and token batches. A mode whose plan does not fit the machine is
refused by realize in one line, and the table says so.

    python bench/bench_base_memory.py --shape 1b --wtypes f16,q8_0,q4_k --batch 2 --seq 256
    python bench/bench_base_memory.py --shape 8b --wtypes q4_k --batch 1 --seq 256 --steps 1

``--md``/``--json`` write the table and the rows (bench/results/ keeps the committed ones).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
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
from bench_lora import (bench_cache, blas_threads, device_description, ensure_toygraph,  # noqa: E402
                        log, peak_rss_bytes, rss_bytes, version)

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
GIB = 1 << 30


def model_file(shape: str, wtype: str) -> Path:
    from random_model import LLAMA1B, LLAMA8B, write_random_llama
    stem = f"llama{shape}-random-{wtype}"
    path = bench_cache() / stem / f"{stem}.gguf"
    if not path.is_file():
        log(f"writing {path} (random weights, {wtype}; once)")
        write_random_llama(path, wtype=wtype, **(LLAMA1B if shape == "1b" else LLAMA8B))
    return path


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def finish(text: str, a, doc: dict) -> None:
    """Print the table; write it to ``--md`` and ``doc`` to ``--json`` when asked."""
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


# --- the child: one realize and a few steps ---------------------------------------------------
def child(spec: dict) -> dict:
    ensure_toygraph()
    from toygraph.core.optimizer import hp_row
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions

    rss0 = rss_bytes()
    t0 = time.perf_counter()
    model = GGUFModel(spec["gguf"])
    recipe = LoRA(targets=TARGETS, rank=spec["rank"], alpha=2.0 * spec["rank"])
    opts = RecipeOptions(seq_len=spec["seq"], batch=spec["batch"], seed=0,
                         checkpoint_activations=spec["checkpoint"])
    recipe.realize(model, model.config, opts)
    out = {"realize_s": time.perf_counter() - t0, "plan": recipe.sess.plan.report(),
           "summary": recipe.sess.plan.summary(), "rss_start": rss0}
    rng = np.random.default_rng(1)
    n, B, T = spec["warmup"] + spec["steps"], spec["batch"], spec["seq"]
    ids = rng.integers(0, model.config.n_vocab, size=(n, 1, B, T), dtype=np.int32)
    labels = np.concatenate([ids[..., 1:], np.full((n, 1, B, 1), -1, np.int32)], axis=-1)
    pos = np.tile(np.arange(T, dtype=np.int32), (1, B, 1))
    backend = recipe.sess.backend
    losses, step_s, cpu_s, decode_s = [], [], [], []
    for i in range(n):
        d0, ts, cs = getattr(backend, "decode_seconds", 0.0), time.perf_counter(), time.process_time()
        losses.append(recipe.step(ids[i], pos, labels[i], hp_row(i + 1, 1e-3), is_first=i == 0))
        step_s.append(time.perf_counter() - ts)
        cpu_s.append(time.process_time() - cs)
        decode_s.append(getattr(backend, "decode_seconds", 0.0) - d0)
        log(f"{spec['tag']} step {i + 1}/{n}: loss {losses[-1]:.6f} {step_s[-1]:.2f} s "
            f"(decode {decode_s[-1]:.2f} s)")
    w = spec["warmup"]
    out.update(losses=[x.hex() for x in losses], step_s=step_s[w:], cpu_s=cpu_s[w:],
               decode_s=decode_s[w:],
               peak_rss=peak_rss_bytes(), threads=blas_threads())
    return out


def child_ab(spec: dict) -> dict:
    """Both modes in one process, their steps interleaved (decode, quantized, decode, ...),
    so both see the same load on a shared machine: step times only (RSS is shared)."""
    ensure_toygraph()
    from toygraph.core.optimizer import hp_row
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions

    model = GGUFModel(spec["gguf"])
    recipes = {}
    for mode in ("decode", "quantized"):
        os.environ["TOYGRAPH_BASE_MEMORY"] = mode
        recipes[mode] = LoRA(targets=TARGETS, rank=spec["rank"], alpha=2.0 * spec["rank"])
        recipes[mode].realize(model, model.config, RecipeOptions(
            seq_len=spec["seq"], batch=spec["batch"], seed=0,
            checkpoint_activations=spec["checkpoint"]))
    rng = np.random.default_rng(1)
    n, B, T = spec["warmup"] + spec["steps"], spec["batch"], spec["seq"]
    ids = rng.integers(0, model.config.n_vocab, size=(n, 1, B, T), dtype=np.int32)
    labels = np.concatenate([ids[..., 1:], np.full((n, 1, B, 1), -1, np.int32)], axis=-1)
    pos = np.tile(np.arange(T, dtype=np.int32), (1, B, 1))
    out = {m: {"losses": [], "step_s": [], "cpu_s": []} for m in recipes}
    for i in range(n):
        for mode, recipe in recipes.items():
            ts, cs = time.perf_counter(), time.process_time()
            loss = recipe.step(ids[i], pos, labels[i], hp_row(i + 1, 1e-3), is_first=i == 0)
            if i >= spec["warmup"]:
                out[mode]["step_s"].append(time.perf_counter() - ts)
                out[mode]["cpu_s"].append(time.process_time() - cs)
            out[mode]["losses"].append(loss.hex())
            log(f"ab {mode} step {i + 1}/{n}: {time.perf_counter() - ts:.2f} s")
    return out


def run_child(spec: dict, work: Path) -> dict:
    spec_path, out_path = work / f"{spec['tag']}.spec.json", work / f"{spec['tag']}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "TOYGRAPH_BASE_MEMORY": spec["mode"]}
    log(f"{spec['tag']}: starting")
    proc = subprocess.run([sys.executable, __file__, "--_child", str(spec_path), str(out_path)],
                          env=env, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not out_path.is_file():
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["?"]
        log(f"{spec['tag']}: failed: {lines[-1]}")
        return {"error": lines[-1][:400]}
    return json.loads(out_path.read_text())


# --- the parent: children, table ---------------------------------------------------------------
def row_text(wtype: str, mode: str, size: int, r: dict, ref: dict | None, tokens: int) -> str:
    if "error" in r:
        return f"| {wtype} | {mode} | {size / GIB:.2f} | refused or failed: {r['error']} " + "| " * 10
    plan = r["plan"]
    step, cpu = statistics.median(r["step_s"]), statistics.median(r["cpu_s"])
    dec = statistics.median(r["decode_s"])
    base = (f"{plan['base_bytes'] / GIB:.2f} + {plan['scratch_bytes'] / GIB:.2f}"
            if plan["base_memory"] == "quantized" else f"{plan['base_bytes'] / GIB:.2f} (f32)")
    same = vs = "—"
    if ref and "error" not in ref and ref is not r:
        same = "yes" if r["losses"] == ref["losses"] else "NO"
        vs = (f"{statistics.median(ref['step_s']) / step:.1%} / "
              f"{statistics.median(ref['cpu_s']) / cpu:.1%}")
    return (f"| {wtype} | {mode} | {size / GIB:.2f} | {base} | {plan['arena_bytes'] / GIB:.2f} "
            f"| {plan['total_bytes'] / GIB:.2f} | {r['peak_rss'] / GIB:.2f} "
            f"| {(r['peak_rss'] - r['rss_start']) / GIB:.2f} | {tokens / step:.1f} | {step:.2f} "
            f"| {cpu:.2f} | {dec:.2f} ({dec / step:.1%}) | {vs} | {same} |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps((child_ab if spec["mode"] == "ab" else child)(spec)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["1b", "8b"], default="1b")
    ap.add_argument("--wtypes", default="f16,q8_0,q4_k")
    ap.add_argument("--modes", default="decode,quantized")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes this many times in turn (load on a shared machine varies)")
    ap.add_argument("--ab", action="store_true",
                    help="instead: both modes in one process, steps interleaved (timing only)")
    ap.add_argument("--checkpoint", action="store_true", help="recompute each block (recompute.py)")
    ap.add_argument("--md", help="write the markdown here too")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    ensure_toygraph()
    uptime_start = uptime()
    if a.ab:
        return ab_main(a, argv, uptime_start)
    rows, lines, docs = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_base_memory.") as work:
        for wtype in a.wtypes.split(","):
            path = model_file(a.shape, wtype)
            for round_ in range(a.rounds):
                ref = None   # the decode row of this round
                for mode in a.modes.split(","):
                    spec = dict(gguf=str(path), mode=mode, batch=a.batch, seq=a.seq,
                                rank=a.rank, steps=a.steps, warmup=a.warmup,
                                checkpoint=a.checkpoint, tag=f"{a.shape}-{wtype}-{mode}-{round_}")
                    r = run_child(spec, Path(work))
                    ref = r if mode == "decode" else ref
                    label = mode if a.rounds == 1 else f"{mode} (round {round_ + 1})"
                    rows.append(row_text(wtype, label, path.stat().st_size, r, ref,
                                         a.batch * a.seq))
                    docs.append({"wtype": wtype, "mode": mode, "round": round_ + 1,
                                 "file_bytes": path.stat().st_size, **r})
    uptime_end = uptime()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    threads = next((d["threads"] for d in docs if "threads" in d), "?")
    lines = [
        f"### QLoRA on the CPU: Llama-{a.shape.upper()}-shaped random GGUF, LoRA step, base "
        f"decoded vs kept quantized — {device_description('cpu', [])}",
        "",
        f"- date: {date}; python {platform.python_version()}; numpy {version('numpy')}; "
        f"threads: {threads}",
        f"- command: `python bench/bench_base_memory.py {' '.join(shlex.quote(x) for x in argv)}`",
        f"- step: batch {a.batch} x seq {a.seq}; LoRA {','.join(TARGETS)} r={a.rank} "
        f"alpha={2 * a.rank}; AdamW; {a.warmup} warm-up + {a.steps} timed steps (median)"
        f"{'; activations recomputed per block' if a.checkpoint else ''}",
        f"- uptime at start: `{uptime_start}`",
        f"- uptime at end: `{uptime_end}` (other sessions share these CPUs: compare rows of "
        "one run only)",
        "",
        "| file | base memory | on disk GiB | base + scratch GiB | arena GiB | plan total GiB "
        "| peak RSS GiB | peak RSS − start GiB | tokens/s | step s | CPU s/step "
        "| decode s/step (share) | speed vs decode (wall / CPU) | losses bit-identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows, "",
        "- base + scratch: `decode` holds the base as f32 (part of the pinned bytes); "
        "`quantized` holds its block bytes (an mmap of the file) plus the one decode scratch",
        "- peak RSS: ru_maxrss of the child (file pages of the mmap'd GGUF included); "
        "− start: minus the RSS before the model was opened",
        "- CPU s/step: the child's CPU time (all its threads) per step, less sensitive than "
        "wall time to other processes on the machine; speed vs decode: the `decode` row's "
        "median step time over this row's, by wall clock and by CPU time",
        "- decode s/step: time in just-in-time decodes (CpuBackend.decode_seconds); losses: "
        "every step's loss as float hex against the `decode` row of the same round",
    ]
    finish("\n".join(lines), a, {"argv": argv, "date": date, "uptime_start": uptime_start,
                                  "uptime_end": uptime_end, "rows": docs})
    return 0 if all("error" not in d or d["mode"] == "decode" for d in docs) else 1


def ab_main(a, argv, uptime_start: str) -> int:
    tokens = a.batch * a.seq
    lines = [f"### Interleaved A/B, Llama-{a.shape.upper()}-shaped, batch {a.batch} x seq "
             f"{a.seq}: base decoded vs kept quantized, steps alternating in one process",
             "", f"- command: `python bench/bench_base_memory.py {' '.join(argv)}`",
             f"- {device_description('cpu', [])}; uptime at start: `{uptime_start}`", "",
             "| file | mode | tokens/s | step s (median) | CPU s/step | speed vs decode "
             "(wall / CPU) | losses bit-identical |", "|---|---|---:|---:|---:|---:|---|"]
    docs = []
    with tempfile.TemporaryDirectory(prefix="bench_base_memory.") as work:
        for wtype in a.wtypes.split(","):
            spec = dict(gguf=str(model_file(a.shape, wtype)), mode="ab", batch=a.batch,
                        seq=a.seq, rank=a.rank, steps=a.steps, warmup=a.warmup,
                        checkpoint=a.checkpoint, tag=f"{a.shape}-{wtype}-ab")
            r = run_child(spec, Path(work))
            docs.append({"wtype": wtype, **r})
            if "error" in r:
                lines.append(f"| {wtype} | failed: {r['error']} | | | | | |")
                continue
            ref = r["decode"]
            for mode, m in r.items():
                step, cpu = statistics.median(m["step_s"]), statistics.median(m["cpu_s"])
                vs = same = "—"
                if mode != "decode":
                    vs = (f"{statistics.median(ref['step_s']) / step:.1%} / "
                          f"{statistics.median(ref['cpu_s']) / cpu:.1%}")
                    same = "yes" if m["losses"] == ref["losses"] else "NO"
                lines.append(f"| {wtype} | {mode} | {tokens / step:.1f} | {step:.2f} | {cpu:.2f} "
                             f"| {vs} | {same} |")
    lines += ["", f"- uptime at end: `{uptime()}`"]
    finish("\n".join(lines), a, {"argv": argv, "rows": docs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
