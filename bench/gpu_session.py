"""The Python side of bench/gpu_session.sh: its checks and the summaries it writes.

    python bench/gpu_session.py golden OUT.json NAME...     tiny experiments on the GPU backend
    python bench/gpu_session.py slice SLICE.gguf OUT.json   SmolLM2 slice, GPU vs CPU
    python bench/gpu_session.py versions                    one line: python and package versions
    python bench/gpu_session.py info                        gguf's path, CUDA available, arch
    python bench/gpu_session.py check-detail LOG STAGE      a check stage's PASS/FAIL lines
    python bench/gpu_session.py bench-detail JSON           a bench_lora.py run in one line
    python bench/gpu_session.py pack-detail JSON            a bench_packing.py run in one line
    python bench/gpu_session.py merge WORK OUT.json         the stages' JSON files as one

The backend the checks treat as "the GPU" is ``$GS_BACKEND`` (default cuda; cpu for a dry
run of the plumbing, or cuda with TOYGRAPH_CUDA_DEVICE=host: the CUDA lowering on the host
executor). A check prints one PASS or FAIL line per item and exits 1 when any failed.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

RTOL = 1e-4   # the backends' usual agreement on a loss (tests/cuda/test_cuda.py)


def gpu_backend() -> str:
    return os.environ.get("GS_BACKEND", "cuda")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float((np.abs(a - b) / np.maximum(np.abs(b), 1e-12)).max())


def failure(name: str) -> str:
    """The traceback of the exception being handled on stderr; its last line for the log."""
    text = traceback.format_exc()
    print(text, file=sys.stderr)
    return f"FAIL {name}: {text.strip().splitlines()[-1]}"


# --- the checks ----------------------------------------------------------------------------------
def golden(out: str, *names: str) -> int:
    """Each tiny experiment on the GPU backend twice (graph replay on) and once with
    TOYGRAPH_CUDA_GRAPHS=0: per-step losses vs the CPU golden (its rtol), and bit-identity."""
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    from toygraph.fixtures.golden import golden_path
    backend, res, ok_all = gpu_backend(), {}, True
    for name in names:
        r = res[name] = {"backend": backend}
        try:
            doc = json.loads(golden_path(name, "cpu").read_text())
            want, rtol = np.array(doc["losses"]), doc["tolerance"]["rtol"]
            runs = []
            for graphs in ("1", "1", "0"):
                os.environ["TOYGRAPH_CUDA_GRAPHS"] = graphs
                t0 = time.perf_counter()
                runs.append([float(x) for x in run_experiment(EXPERIMENTS[name], backend=backend)])
                r.setdefault("seconds", []).append(round(time.perf_counter() - t0, 2))
            os.environ["TOYGRAPH_CUDA_GRAPHS"] = "1"
            worst = np.abs(np.array(runs[0]) - want) / np.maximum(np.abs(want), 1e-12)
            r.update(losses=runs[0], golden_cpu=want.tolist(), rtol=rtol,
                     max_rel_vs_cpu=float(worst.max()), worst_step=int(worst.argmax()) + 1,
                     bit_identical_twice=runs[0] == runs[1],
                     bit_identical_graphs_off=runs[0] == runs[2])
            if runs[0] != runs[1]:
                r["second_run"] = runs[1]
            if runs[0] != runs[2]:
                r["graphs_off_run"] = runs[2]
            ok = (r["max_rel_vs_cpu"] <= rtol and r["bit_identical_twice"]
                  and r["bit_identical_graphs_off"])
            line = (f"{'PASS' if ok else 'FAIL'} {name}: max rel vs cpu golden "
                    f"{r['max_rel_vs_cpu']:.2e} at step {r['worst_step']} (rtol {rtol:.0e}); "
                    f"twice identical {r['bit_identical_twice']}; graphs-off identical "
                    f"{r['bit_identical_graphs_off']}; loss {runs[0][0]:.6f} -> "
                    f"{runs[0][-1]:.6f}; s {r['seconds']}")
        except Exception:
            r["error"] = traceback.format_exc()
            ok, line = False, failure(name)
        r["ok"] = ok
        ok_all &= ok
        print(line, flush=True)
    Path(out).write_text(json.dumps(res, indent=1))
    return 0 if ok_all else 1


def _forward_loss(path: Path, tokens, backend: str) -> float:
    """Mean next-token cross-entropy of the rows of ``tokens`` on ``backend``."""
    from toygraph.inference.language_model import LanguageModel
    return LanguageModel(str(path), backend=backend).loss([list(map(int, r)) for r in tokens])[0]


def _slice_forward(path: Path, backend: str) -> tuple[bool, dict, str]:
    from toygraph.gguf.tokenizer import Tokenizer
    from toygraph.models.model import GGUFModel
    cfg = GGUFModel(path).config
    tok = Tokenizer.from_gguf(path)
    texts = ["The capital of France is Paris. It is known for the Eiffel Tower and",
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5, of course"]
    ids = [tok.encode(t) for t in texts]
    T = min(len(i) for i in ids)
    tokens = np.array([i[:T] for i in ids], np.int32)
    t0 = time.perf_counter()
    cpu, gpu = _forward_loss(path, tokens, "cpu"), _forward_loss(path, tokens, backend)
    gpu2 = _forward_loss(path, tokens, backend)
    ok = rel(gpu, cpu) <= RTOL and gpu == gpu2
    r = {"config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_vocab": cfg.n_vocab},
         "tokens": list(tokens.shape), "cpu": cpu, "gpu": gpu, "gpu_again": gpu2,
         "rel": rel(gpu, cpu), "identical": gpu == gpu2, "ok": ok,
         "seconds": round(time.perf_counter() - t0, 2)}
    return ok, r, (f"{'PASS' if ok else 'FAIL'} forward {tokens.shape}: cpu {cpu:.7f} {backend} "
                   f"{gpu:.7f} rel {rel(gpu, cpu):.2e}; again identical {gpu == gpu2}")


def _slice_lora(backend: str) -> tuple[bool, dict, str]:
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    exp = EXPERIMENTS["lora_qv_smollm2"]
    t0 = time.perf_counter()
    cpu = [float(x) for x in run_experiment(exp, backend="cpu")]
    t1 = time.perf_counter()
    gpu = [float(x) for x in run_experiment(exp, backend=backend)]
    gpu2 = [float(x) for x in run_experiment(exp, backend=backend)]
    ok = rel(gpu, cpu) <= RTOL and gpu == gpu2
    r = {"cpu": cpu, "gpu": gpu, "gpu_again": gpu2, "rel": rel(gpu, cpu), "identical": gpu == gpu2,
         "ok": ok, "seconds_cpu": round(t1 - t0, 2),
         "seconds_gpu_x2": round(time.perf_counter() - t1, 2)}
    return ok, r, (f"{'PASS' if ok else 'FAIL'} lora_qv_smollm2 on the slice ({len(cpu)} steps): "
                   f"max rel {rel(gpu, cpu):.2e}; loss cpu {cpu[0]:.6f} -> {cpu[-1]:.6f}, "
                   f"{backend} {gpu[0]:.6f} -> {gpu[-1]:.6f}; again identical {gpu == gpu2}")


def slice_check(gguf: str, out: str) -> int:
    """SmolLM2 6-block slice: the forward loss on real text and the lora_qv_smollm2
    experiment (4 LoRA steps, capitals data), GPU backend vs CPU within 1e-4 relative; the
    GPU side twice identical."""
    path, backend = Path(gguf).resolve(), gpu_backend()
    os.environ["TOYGRAPH_SMOLLM2"] = str(path)   # the experiment's model is the slice
    res, ok_all = {"gguf": str(path), "bytes": path.stat().st_size, "backend": backend}, True
    for key, check, args in (("forward", _slice_forward, (path, backend)),
                             ("lora_qv_smollm2", _slice_lora, (backend,))):
        try:
            ok, res[key], line = check(*args)
        except Exception:
            res[f"{key}_error"] = traceback.format_exc()
            ok, line = False, failure(key)
        ok_all &= ok
        print(line, flush=True)
    res["ok"] = ok_all
    Path(out).write_text(json.dumps(res, indent=1))
    return 0 if ok_all else 1


# --- what the summary prints ---------------------------------------------------------------------
def versions() -> int:
    import importlib.metadata as md
    import platform

    def v(p):
        try:
            return md.version(p)
        except Exception:
            return "-"
    print(f"python {platform.python_version()}, " + ", ".join(
        f"{p} {v(p)}" for p in ("numpy", "gguf", "cuda-bindings", "nvidia-cuda-nvrtc", "torch",
                                "transformers", "peft", "toygraph")))
    return 0


def info() -> int:
    import gguf
    import toygraph.fixtures.experiments  # noqa: F401  (the checks need the fixtures)
    from toygraph.cuda import driver
    ok = driver.available()
    print("gguf", gguf.__file__, "| cuda available:", ok, "| arch:",
          driver.device_arch() if ok else "-")
    return 0


def check_detail(log: str, stage: str) -> int:
    """The PASS/FAIL lines one check stage wrote to LOG (after its last header): the counts,
    then every FAIL line, or the last PASS lines when none failed."""
    lines = Path(log).read_text(errors="replace").splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith(f"===== {stage} (timeout")),
                default=0)
    res = [line for line in lines[start:] if line.startswith(("PASS ", "FAIL "))]
    fails = [line for line in res if line.startswith("FAIL ")]
    print(f"{len(res) - len(fails)} PASS, {len(fails)} FAIL: "
          + "; ".join(line[:220] for line in (fails or res[-2:])))
    return 0


def _load(path: str):
    try:
        return json.loads(Path(path).read_text())
    except Exception:
        print("no JSON written")
        return None


def bench_detail(path: str) -> int:
    d = _load(path)
    if d is not None:
        parts = [f"{r.get('impl')} {r.get('dtype')}: "
                 + (f"{r.get('tokens_per_s', 0):.0f} tok/s, {r['step_ms']:.1f} ms"
                    if r.get("step_ms") else "no timing") for r in d.get("rows", [])]
        print("; ".join(parts) or "no rows")
    return 0


def pack_detail(path: str) -> int:
    d = _load(path)
    if d is not None:
        print("; ".join(f"{'packed' if r['pack'] else 'unpacked'} {r['real_tok_s']:.0f} real "
                        f"tok/s ({r['timed_efficiency']:.0%} real)" for r in d["rows"])
              + f"; speedup {d['speedup']:.2f}x")
    return 0


def merge(work: str, out: str) -> int:
    """golden.json, slice.json, nccl.json and bench-*.json of WORK as one document."""
    doc = {"golden": None, "slice": None, "nccl": None, "bench": {}}
    for p in sorted(Path(work).glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except Exception as e:
            d = {"unreadable": str(e)}
        if p.stem in ("golden", "slice", "nccl"):
            doc[p.stem] = d
        elif p.stem.startswith("bench-"):
            doc["bench"][p.stem[len("bench-"):]] = d
    Path(out).write_text(json.dumps(doc, indent=1))
    return 0


COMMANDS = {"golden": golden, "slice": slice_check, "versions": versions, "info": info,
            "check-detail": check_detail, "bench-detail": bench_detail,
            "pack-detail": pack_detail, "merge": merge}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python bench/gpu_session.py {{{','.join(COMMANDS)}}} ARGS...")
    sys.exit(COMMANDS[sys.argv[1]](*sys.argv[2:]))
