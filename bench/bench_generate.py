"""Tokens/s of greedy generation with the KV cache (prefill + one-token decode graphs) and
without it (the whole window rerun per token), same model, prompt and length.

    python bench/bench_generate.py                        # SmolLM2 on the CPU, 256 tokens
    python bench/bench_generate.py --backend cuda --json out.json --md out.md

Both paths run through ``LanguageModel.next_logits``, the loop ``generate`` uses, with
greedy picks and no stop token, so each makes exactly ``--new-tokens`` tokens (the
sequence length, and so every graph shape, is the same as a 256-token ``generate``). The
first token's time holds realize and the prompt's forward; tokens/s is over the tokens
after it. A path's per-token work does not depend on the position (the full-window graph
is [1, T] for every token; decode attends over the whole masked cache), so the slow path
may be cut short with ``--full-tokens`` (its graph stays the one for the whole length).
The load average is recorded before and after: the numbers only mean something on a
quiet machine.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

PROMPT = "The history of the printing press begins"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def run_path(lm, ids, end, n_tokens, kv_cache):
    """Greedy tokens and timings of one path; ``n_tokens`` of the ``end - len(ids)``."""
    context = list(ids)
    t0 = time.perf_counter()
    logits = lm.next_logits(context, end, kv_cache=kv_cache)
    stamps = []
    for _ in range(n_tokens):
        context.append(int(np.argmax(next(logits))))
        stamps.append(time.perf_counter())
    steady = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return context[len(ids):], {"path": "kv-cache" if kv_cache else "full-window",
                                "tokens": n_tokens, "first_token_s": stamps[0] - t0,
                                "tokens_per_s": steady, "total_s": stamps[-1] - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="GGUF file, or 'smollm2'")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--full-tokens", type=int, default=None,
                    help="tokens to time on the full-window path (default: --new-tokens)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--json", help="write the rows and environment here")
    ap.add_argument("--md", help="write the markdown table here too")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)

    from toygraph.models.catalog import resolve_model
    from toygraph.inference.language_model import LanguageModel
    path = Path(resolve_model(args.model))
    load_before = os.getloadavg()
    rows, outputs = [], {}
    for kv_cache in (True, False):
        lm = LanguageModel(path, backend=args.backend)
        ids = lm.tokenizer.encode(args.prompt)
        end = len(ids) + args.new_tokens
        if end > lm.seq_len:
            raise SystemExit(f"bench_generate: {len(ids)} prompt + {args.new_tokens} new tokens "
                             f"exceed {path.name}'s context of {lm.seq_len}")
        n = args.new_tokens if kv_cache else (args.full_tokens or args.new_tokens)
        print(f"[bench_generate] {'kv-cache' if kv_cache else 'full-window'}: {n} tokens "
              f"(sequence of {end})", file=sys.stderr, flush=True)
        outputs[kv_cache], row = run_path(lm, ids, end, n, kv_cache)
        rows.append(row)
        del lm
    n_common = min(len(outputs[True]), len(outputs[False]))
    same = outputs[True][:n_common] == outputs[False][:n_common]
    speedup = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "model": str(path), "backend": args.backend, "prompt_tokens": len(ids),
           "new_tokens": args.new_tokens, "cpus": os.cpu_count(), "cpu": cpu_model(),
           "python": platform.python_version(), "numpy": np.__version__,
           "command": " ".join(["python"] + sys.argv),
           "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "(unset)"),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "same_greedy_tokens": same, "compared_tokens": n_common, "speedup": speedup,
           "note": args.note}
    lines = [f"Greedy generation, {path.name}, backend {args.backend}, prompt of {len(ids)} "
             f"tokens + {args.new_tokens} new ({env['date']}; load average "
             f"{load_before[0]:.1f} before, {env['loadavg_after'][0]:.1f} after, "
             f"{env['cpus']} CPUs, {env['cpu']}; OPENBLAS_NUM_THREADS="
             f"{env['OPENBLAS_NUM_THREADS']})", "", f"Command: `{env['command']}`", "",
             "| path | tokens timed | first token (s) | tokens/s after it | total (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['tokens']} | {r['first_token_s']:.2f} | "
              f"{r['tokens_per_s']:.2f} | {r['total_s']:.1f} |" for r in rows]
    lines += ["", f"Speedup of the KV cache: **{speedup:.1f}x** tokens/s; the same greedy "
              f"tokens on both paths ({n_common} compared): {'yes' if same else 'NO'}."]
    table = "\n".join(lines)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
