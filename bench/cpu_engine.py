"""The CPU engine's table: what computing on the blocks costs and saves, beside the references.

Sections (``--sections``, comma-separated; all by default):

- ``decode``: parameters decoded per second per block type (random block bytes, finite
  scales), on one thread into an L2-sized panel (what the products do) and on every thread
  into a 64 MiB tensor (memory-bound), beside this machine's memory bandwidth (numpy copy
  and sum over 256 MiB).
- ``step``: a LoRA step (targets q,k,v,o, rank 8, one sequence of 128 tokens unless told)
  on each model row: toygraph with the base decoded to f32 (``--base-memory decode``) and
  on the blocks (the default), both replayed in the engine (the default,
  ``TOYGRAPH_CPU_REPLAY=engine``); the blocks on numpy's kernels (``TOYGRAPH_CPU_REPLAY=numpy``,
  the reference); torch + PEFT (transformers loading the same GGUF); tokens/s, peak RSS,
  the blocks' speed against the decoded step's and the file's size.
  Each in its own child (bench_lora.py's); ``--rounds N`` alternates the decoded and blocks
  children N times and pools their step times (the host's slow spells fall on both). ``llama8b4-q4_k`` is the 8B's matrices and head
  with 4 of its 32 layers; the whole ``llama8b-q4_k`` runs on the blocks only (its f32
  copy, 32 GB, fits neither the decoded path nor torch).
- ``interleaved``: the fair speed comparison of the step rows: both base modes replayed in
  the engine and the blocks on numpy's kernels, realized in one process and their steps
  alternating (2 x --steps of each, the first dropped); the median step of each and the
  range of the step-by-step ratio of the engine's replay to numpy's kernels.
- ``generate``: greedy generation, the same prompt, 64 new tokens, the same threads:
  toygraph on the blocks (numpy's replay, and replayed in the engine:
  ``TOYGRAPH_CPU_REPLAY=engine``, also at caches of ``--caches`` rows, most of them empty),
  toygraph decoded to f32 (the reference arithmetic: BLAS),
  llama.cpp (llama-cpp-python) on the same file; tokens/s after the first token, the greedy
  tokens against the f32 path and the logits' largest difference along the f32 path's
  tokens; and GRPO's rollouts (the batched sampler, a group of 4) in tokens/s. With
  ``--rounds N`` the blocks and llama.cpp runs are repeated in turn N times: medians, and
  the range of the rounds' ratios.
- ``rollouts``: GRPO's rollouts against one sequence, replayed in the engine: one sequence's
  greedy tokens/s (as ``generate``) and the batched sampler's (a group of ``--group``, 32
  new tokens at temperature 1; the group's one prompt through the prefill once, as GRPO
  runs it, where the revision's sampler can), over the whole call and after its prefill
  (the prompt's forward, in the whole call's time), and their ratios; with
  ``--against REV`` the same children also run on git revision REV's toygraph (``git
  archive``'d to a temporary folder), the two alternating ``--rounds`` times, medians.
- ``contention``: the demo's LoRA step (SmolLM2, rank 16 on attention and MLP, 4 x 64
  tokens) alone and beside one and two CPU-bound processes, toygraph and torch + PEFT: the
  slowdown (ideal: 2x and 3x on 2 cores... the step's share of the CPUs).

    python bench/cpu_engine.py --md bench/results/cpu-engine-<date>.md --json ....json
    python bench/cpu_engine.py --sections generate --models smollm2,qwen2.5-coder-0.5b

Numbers only mean something on a quiet machine: the load average is printed before and
after each section. Progress goes to stderr, the table to stdout.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_lora import (bench_cache, ensure_toygraph, log, make_inputs, peak_rss_bytes,  # noqa: E402
                        run_child, version)

GIB = 1 << 30
PROMPT = "The history of the printing press begins"
#: model rows: how each is found (a catalog name, or a random Llama shape and block type)
STEP_MODELS = ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b", "llama1b-q4_k", "llama8b4-q4_k")
#: random Llama shapes: ``llama8b4`` is Llama-3.1-8B's dims, vocabulary and untied head with
#: 4 of its 32 layers (1.9e9 weights), so that its f32 copy fits beside the blocks and
#: decoded-vs-blocks can be compared on the 8B's matrices; ``llama8b`` is the whole model.
RANDOM_SHAPES = {"llama1b": {}, "llama8b": {}, "llama8b4": {"n_layer": 4}}
GEN_MODELS = ("smollm2", "qwen2.5-coder-0.5b")
#: The variables that cap an instruction set (the engine's build, torch's kernels, MKL's and
#: oneDNN's), named in a table's header when set: a comparison at AVX2 on a CPU with AVX-512
#: sets all four (TOYGRAPH_CPU_TARGET=x86-64-v3 ATEN_CPU_CAPABILITY=avx2
#: MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2).
ISA_CAPS = ("TOYGRAPH_CPU_TARGET", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
            "ONEDNN_MAX_CPU_ISA")


def model_file(name: str) -> Path:
    if name.split("-")[0] in RANDOM_SHAPES:
        from random_model import LLAMA1B, LLAMA8B, write_random_llama
        shape, wtype = name.split("-")
        path = bench_cache() / f"{shape}-random-{wtype}" / f"{shape}-random-{wtype}.gguf"
        if not path.is_file():
            log(f"writing {path} (random weights, {wtype}; once)")
            dims = dict(LLAMA1B if shape == "llama1b" else LLAMA8B, **RANDOM_SHAPES[shape])
            write_random_llama(path, wtype=wtype, **dims)
        return path
    from toygraph.models.catalog import resolve_model
    return Path(resolve_model(name))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def best_of(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# --- decode ------------------------------------------------------------------------------------
def random_blocks(fmt: str, n_blocks: int, rng) -> np.ndarray:
    """Random block bytes with finite f16 scales (every other bit pattern)."""
    from toygraph.gguf import blocks
    _, size = blocks.BLOCK[fmt]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for field in ("d", "dmin", "m"):
        off = blocks.LAYOUT.get(fmt, {}).get(field)
        if off is not None:
            vals = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
            b[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return b


def section_decode(a) -> tuple[str, dict]:
    from toygraph.cpu import engine, threads
    from toygraph.gguf import blocks
    rng = np.random.default_rng(0)
    big = np.ones(1 << 28, np.uint8)
    copy = np.empty_like(big)
    read_gbs = big.nbytes / best_of(lambda: big.view(np.uint64).sum(), 3) / 1e9
    copy_gbs = 2 * big.nbytes / best_of(lambda: np.copyto(copy, big), 3) / 1e9
    del big, copy
    n_threads = threads.resolve(a.threads)
    lines = [f"Memory bandwidth (numpy, 256 MiB): sum {read_gbs:.1f} GB/s read, copy "
             f"{copy_gbs:.1f} GB/s read+write. Engine built for {engine.simd()}.", "",
             f"| format | bytes/param | panel, 1 thread: Gparam/s | tensor, 1 thread | tensor, "
             f"{n_threads} threads | tensor, {n_threads} threads: GB/s read |",
             "|---|---:|---:|---:|---:|---:|"]
    rows = []
    for fmt in engine.FORMATS:
        qk, size = blocks.BLOCK[fmt]
        panel_shape, tensor_shape = (64, 1024), (8192, 2048)
        raw_t = (rng.integers(0, 1 << 16, tensor_shape[0] * tensor_shape[1], dtype=np.uint16)
                 .view(np.uint8) if qk == 1 else
                 random_blocks(fmt, tensor_shape[0] * tensor_shape[1] // qk, rng))
        raw_t = blocks.as_bytes(raw_t)
        raw_p = raw_t[:blocks.nbytes(fmt, panel_shape)]
        out_t, out_p = np.empty(tensor_shape, np.float32), np.empty(panel_shape, np.float32)
        engine.use_threads(1)
        panel = best_of(lambda: engine.decode(raw_p, fmt, out_p.size, out_p), 20)
        engine.decode(raw_t, fmt, out_t.size, out_t)   # the output's pages faulted in, once
        one = best_of(lambda: engine.decode(raw_t, fmt, out_t.size, out_t), a.repeat)
        engine.use_threads(n_threads)
        many = best_of(lambda: engine.decode(raw_t, fmt, out_t.size, out_t), a.repeat)
        row = dict(format=fmt, bytes_per_param=size / qk, panel_1=out_p.size / panel / 1e9,
                   tensor_1=out_t.size / one / 1e9, tensor_n=out_t.size / many / 1e9,
                   read_gbs=raw_t.size / many / 1e9)
        rows.append(row)
        lines.append(f"| {fmt} | {row['bytes_per_param']:.3f} | {row['panel_1']:.2f} | "
                     f"{row['tensor_1']:.2f} | {row['tensor_n']:.2f} | {row['read_gbs']:.1f} |")
    engine.use_threads(a.threads)
    return "\n".join(lines), {"read_gbs": read_gbs, "copy_gbs": copy_gbs, "rows": rows}


# --- step --------------------------------------------------------------------------------------
def section_step(a, work: Path) -> tuple[str, dict]:
    lines = ["| model | file GiB | toygraph decoded (engine): tok/s | peak RSS GiB | toygraph "
             "blocks, numpy's kernels: tok/s | peak RSS GiB | toygraph blocks (engine, the "
             "default): tok/s | peak RSS GiB | blocks / decoded (engine) | torch + PEFT: tok/s | "
             "peak RSS GiB | blocks (engine) / torch | loss step 1: decoded / numpy's / blocks / "
             "torch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    doc = []
    for name in a.models_step:
        path = model_file(name)
        ns = argparse.Namespace(targets=tuple(a.targets.split(",")), rank=a.rank,
                                alpha=2.0 * a.rank, seed=42, init_scale=0.01, warmup=a.warmup,
                                steps=a.steps, batch=a.batch, seq=a.seq)
        d = work / name
        d.mkdir()
        make_inputs(d, path, ns)
        base = dict(device="cpu", gguf=str(path), seq=a.seq, batch=a.batch, targets=list(ns.targets),
                    rank=a.rank, alpha=ns.alpha, lr=1e-3, clip=1.0, seed=42, init_scale=0.01,
                    dtype="f32", adapter_dir=str(d / "adapter"), adapter_npz=str(d / "adapter.npz"),
                    data=str(d / "data.npz"), op_profile=False, hf_dir=None, threads=a.threads,
                    mode="full")
        got = {}
        # decoded and blocks alternate --rounds times (their step times pooled), so a slow
        # spell of a shared host falls on both; torch + PEFT runs once
        for rnd in range(a.rounds):
            # decoded and replay are the engine's replay (the default) of the two base
            # modes; blocks is the same step on numpy's kernels, the reference
            for tag, impl, env in (("decoded", "toygraph", {"TOYGRAPH_BASE_MEMORY": "decode",
                                                            "TOYGRAPH_CPU_REPLAY": "engine"}),
                                   ("blocks", "toygraph", {"TOYGRAPH_BASE_MEMORY": "auto",
                                                           "TOYGRAPH_CPU_REPLAY": "numpy"}),
                                   ("replay", "toygraph", {"TOYGRAPH_BASE_MEMORY": "auto",
                                                           "TOYGRAPH_CPU_REPLAY": "engine"}),
                                   ("torch", "torch-eager", {})):
                if tag != "replay" and name.startswith("llama8b-"):
                    got[tag] = {"error": "not run: its f32 weights (32 GB) do not fit"}
                    continue
                if tag == "torch" and rnd < a.rounds - 1:
                    continue
                r = run_child(d, dict(base, impl=impl), f"{name}-{tag}-{rnd}", env)
                got[tag] = pool_rounds(got.get(tag), r, a.warmup)
        doc.append({"model": name, "file_bytes": path.stat().st_size, **got})
        lines.append(step_row(name, path.stat().st_size, got, a.batch * a.seq, a.warmup))
    return "\n".join(lines), {"rows": doc}


def pool_rounds(before: dict | None, r: dict, warmup: int) -> dict:
    """One child's result, its step times after warmup added to the earlier rounds' (their
    warmup steps kept once, at the front), its peak RSS the largest; an error wins."""
    if before is None or "error" in r:
        return r
    if "error" in before:
        return before
    return dict(r, step_s=before["step_s"] + r["step_s"][warmup:],
                peak_rss=max(before.get("peak_rss", 0), r.get("peak_rss", 0)))


def step_row(name: str, size: int, got: dict, tokens: int, warmup: int) -> str:
    def speed(r):
        return tokens / statistics.median(r["step_s"][warmup:]) if "step_s" in r else None

    cells, rates = [], {}
    for tag in ("decoded", "blocks", "replay", "torch"):
        r = got[tag]
        if "error" in r:
            cells += [r["error"][:60], "—"]
            continue
        rates[tag] = speed(r)
        peak = r.get("peak_rss", r.get("peak_bytes", 0))
        cells += [f"{rates[tag]:.1f}", f"{peak / GIB:.2f}"]
    ratio = (f"{rates['replay'] / rates['decoded']:.0%}" if {"replay", "decoded"} <= rates.keys()
             else "—")
    vs_torch = (f"{rates['replay'] / rates['torch']:.2f}x" if {"replay", "torch"} <= rates.keys()
                else "—")
    first = " / ".join(f"{got[t]['losses'][0]:.5f}" if "losses" in got[t] else "—"
                       for t in ("decoded", "blocks", "replay", "torch"))
    return (f"| {name} | {size / GIB:.2f} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} "
            f"| {cells[4]} | {cells[5]} | {ratio} | {cells[6]} | {cells[7]} | {vs_torch} | {first} |")


def child_interleaved(spec: dict) -> dict:
    """Both base modes replayed in the engine, and the blocks on numpy's kernels, realized in
    this process and their LoRA steps interleaved (decoded, numpy's, blocks, then the
    reverse order, ...):
    the same tokens, so a slow spell of the host falls on all; the times of every step
    after the first."""
    from toygraph.core.optimizer import hp_row
    from toygraph.cpu import engine
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    engine.use_threads(spec["threads"])
    model = GGUFModel(spec["gguf"])
    recipes = {}
    for mode, base, replay in (("decode", "decode", "engine"), ("quantized", "quantized", "numpy"),
                               ("replay", "quantized", "engine")):
        os.environ["TOYGRAPH_CPU_REPLAY"] = replay   # read when the session realizes
        r = LoRA(targets=tuple(spec["targets"]), rank=spec["rank"], alpha=2.0 * spec["rank"])
        r.realize(model, model.config, RecipeOptions(seq_len=spec["seq"], batch=spec["batch"],
                                                     seed=42, base_memory=base))
        recipes[mode] = r
    rng = np.random.default_rng(42)
    ids = rng.integers(0, model.config.n_vocab, (1, spec["batch"], spec["seq"])).astype(np.int32)
    pos = np.tile(np.arange(spec["seq"], dtype=np.int32), (1, spec["batch"], 1))
    labels = np.concatenate([ids[..., 1:], np.full(ids.shape[:-1] + (1,), -1, np.int32)], -1)
    times = {m: [] for m in recipes}
    for i in range(spec["steps"] + 1):
        for mode, r in (list(recipes.items()) if i % 2 == 0 else list(recipes.items())[::-1]):
            t = time.perf_counter()
            r.step(ids, pos, labels, hp_row(i + 1, 1e-3), is_first=(i == 0))
            times[mode].append(time.perf_counter() - t)
    return {m: t[1:] for m, t in times.items()}


def section_interleaved(a, work: Path) -> tuple[str, dict]:
    lines = ["| model | decoded (engine): s/step (median) | blocks, numpy's kernels: s/step | "
             "blocks (engine): s/step | blocks / decoded (engine) | engine / numpy's kernels | "
             "pairwise engine / numpy's, least..most |",
             "|---|---:|---:|---:|---:|---:|---|"]
    doc = []
    for name in a.models_step:
        if name.startswith("llama8b-"):
            continue
        spec = dict(kind="interleaved", gguf=str(model_file(name)), threads=a.threads_n,
                    targets=a.targets.split(","), rank=a.rank, batch=a.batch, seq=a.seq,
                    steps=2 * a.steps)
        got = run_child_here(spec, work, f"{name}-interleaved")
        doc.append({"model": name, **got})
        if "error" in got:
            lines.append(f"| {name} | {got['error'][:60]} | | | |")
            continue
        d, b, r = (statistics.median(got[m]) for m in ("decode", "quantized", "replay"))
        pairs = [x / y for x, y in zip(got["quantized"], got["replay"])]
        lines.append(f"| {name} | {d:.2f} | {b:.2f} | {r:.2f} | {d / r:.0%} | {b / r:.2f}x | "
                     f"{min(pairs):.2f}x..{max(pairs):.2f}x |")
    return "\n".join(lines), {"rows": doc}


# --- generate ----------------------------------------------------------------------------------
def child_generate(spec: dict) -> dict:
    """One generation path in this process: tokens/s after the first token and the greedy
    ids; toygraph also the logits along ``follow`` (another path's greedy tokens, fed to
    this one) compared with ``follow_logits``, and GRPO's rollouts."""
    if spec["impl"] == "llama.cpp":
        from llama_cpp import Llama
        llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"],
                    n_threads_batch=spec["threads"], n_ctx=512, verbose=False)
        stamps, out = [], []
        for tok in llm.generate(llm.tokenize(PROMPT.encode(), add_bos=False), temp=0.0, top_k=1):
            stamps.append(time.perf_counter())
            out.append(int(tok))
            if len(out) >= spec["new"]:
                break
        res = {"ids": out, "tok_s": (len(out) - 1) / (stamps[-1] - stamps[0])}
        if spec.get("follow"):   # its logits along the f32 path's tokens, after the timing
            del llm
            llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_ctx=512,
                        n_threads_batch=spec["threads"], logits_all=True, verbose=False)
            prompt = spec["follow_prompt"]
            llm.eval(prompt + spec["follow"][:-1])
            along = np.asarray(llm.scores[len(prompt) - 1:len(prompt) - 1 + len(spec["follow"])],
                               np.float64)
            ref = np.asarray(spec["follow_logits"])
            res["max_logit_diff"] = float(np.abs(along - ref).max())
        return res
    os.environ["TOYGRAPH_BASE_MEMORY"] = spec["base_memory"]
    os.environ["TOYGRAPH_CPU_REPLAY"] = spec.get("replay", "numpy")
    from toygraph.cpu import engine
    from toygraph.inference.language_model import LanguageModel
    engine.use_threads(spec["threads"])
    lm = LanguageModel(spec["gguf"])
    prompt = lm.tokenizer.encode(PROMPT)
    end = len(prompt) + spec["new"]
    if spec.get("cache"):   # the speed with a cache of this many rows (most of them empty)
        _, stamps, _ = greedy(lm, prompt, end, cache=max(spec["cache"], end))
        return {"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}
    ids, stamps, rows = greedy(lm, prompt, end)
    out = {"ids": ids, "tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "prompt": prompt}
    if spec.get("keep_logits"):
        out["logits"] = [r.tolist() for r in rows]
    if spec.get("follow"):
        _, _, along = greedy(lm, prompt, end, follow=spec["follow"])
        ref = np.asarray(spec["follow_logits"])
        out["max_logit_diff"] = float(np.abs(np.asarray(along) - ref).max())
        out["logit_scale"] = float(np.abs(ref).max())
        # per token: this path's largest logit error, and the f32 path's margin between its
        # first and second choice (a greedy pick can flip only where error ~ margin)
        out["row_diffs"] = np.abs(np.asarray(along) - ref).max(axis=1).tolist()
        top2 = np.sort(ref, axis=1)[:, -2:]
        out["f32_margins"] = (top2[:, 1] - top2[:, 0]).tolist()
    if spec.get("rollouts"):
        out["rollouts_tok_s"], out["rollouts_after_prefill_tok_s"] = rollout_speed(
            lm, prompt, spec["rollouts"], split=True)
    return out


def greedy(lm, prompt: list[int], end: int, follow=None, cache: int | None = None):
    """(new ids, the time each logits row arrived, the rows): greedy picks, or ``follow``'s
    tokens fed in turn (the rows along another path's sequence), up to ``end`` tokens;
    ``cache``: the KV cache's rows (default ``end``)."""
    context = list(prompt)
    logits = lm.next_logits(context, cache or end)
    stamps, rows = [], []
    while len(context) < end:
        row = np.asarray(next(logits), np.float64)
        stamps.append(time.perf_counter())
        rows.append(row)
        context.append(int(np.argmax(row)) if follow is None else follow[len(rows) - 1])
    return context[len(prompt):], stamps, rows


def rollout_speed(lm, prompt: list[int], group: int, new: int = 32, split: bool = False):
    """GRPO's batched sampler (inference/batched.py): a group of completions of one prompt,
    sampled at temperature 1; tokens/s over the group, after a first (realizing) round.
    ``split``: (that, the tokens after each row's first / the time after the prefill)."""
    from toygraph.inference.batched import BatchedGenerator
    from toygraph.inference.sampling import SamplingOptions
    # One prefill row for the group's one prompt (GRPO's); an --against revision older
    # than that runs the prefill over every row
    shared = ({"prompt_rows": 1} if "prompt_rows" in
              inspect.signature(BatchedGenerator).parameters else {})
    gen = BatchedGenerator(lm.model, rows=group, prompt_len=len(prompt),
                           cache_len=len(prompt) + new, **shared)
    opts = SamplingOptions(temperature=1.0, seed=0)
    gen.generate([prompt] * group, new, opts)
    ends, run = [], gen.sess.run_program

    def timed(program):   # the prefill is the call's first program
        run(program)
        ends.append(time.perf_counter())

    gen.sess.run_program = timed
    t0 = time.perf_counter()
    done = gen.generate([prompt] * group, new, opts)
    t1 = time.perf_counter()
    n = sum(len(c) for c in done)
    return (n / (t1 - t0), (n - group) / (t1 - ends[0])) if split else n / (t1 - t0)


def run_child_here(spec: dict, work: Path, tag: str, root: Path | None = None) -> dict:
    """Run child_generate (or child_interleaved) on ``spec`` in a process of its own, with
    the toygraph of the checkout at ``root`` first on its path (``--against``) if given."""
    spec_path, out_path = work / f"{tag}.json", work / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    log(f"{tag}: starting")
    env = None
    if root is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, __file__, "--_child", str(spec_path), str(out_path)],
                          stdout=sys.stderr, stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0 or not out_path.is_file():
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
        log(f"{tag}: FAILED: {last[0]}")
        return {"error": last[0][:200]}
    return json.loads(out_path.read_text())


def section_generate(a, work: Path) -> tuple[str, dict]:
    lines = [f"| model | toygraph blocks: tok/s | replayed in the engine | toygraph decoded "
             f"(f32 path) | llama.cpp | blocks / llama.cpp | replayed / llama.cpp | greedy "
             f"tokens = f32 path (blocks; replayed) | logits max diff along it (replayed's; "
             f"llama.cpp's; max |logit|) | GRPO rollouts, group of {a.group}: tok/s (replayed) "
             f"| replayed at a cache of {' / '.join(str(c) for c in a.caches)} rows: tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|"]
    doc = []
    for name in a.models_gen:
        path = str(model_file(name))
        base = dict(gguf=path, threads=a.threads_n, new=a.new)
        f32 = run_child_here(dict(base, impl="toygraph", base_memory="decode",
                                      keep_logits=True), work, f"{name}-gen-f32")
        follow = {} if "error" in f32 else {"follow": f32["ids"], "follow_logits": f32["logits"]}
        blk = run_child_here(dict(base, impl="toygraph", base_memory="auto",
                                      rollouts=a.group, **follow), work, f"{name}-gen-blocks")
        rep = run_child_here(dict(base, impl="toygraph", base_memory="auto", replay="engine",
                                  rollouts=a.group, **follow), work, f"{name}-gen-replay")
        caches = [run_child_here(dict(base, impl="toygraph", base_memory="auto", replay="engine",
                                      cache=c), work, f"{name}-gen-replay-cache{c}").get("tok_s")
                  for c in a.caches]
        # llama.cpp's logits along the f32 path too, fed toygraph's prompt ids
        ref = run_child_here(dict(base, impl="llama.cpp", **follow, follow_prompt=f32.get("prompt")),
                             work, f"{name}-gen-llama")
        # --rounds: more runs of the two timed paths in turn (speed only), so a slow spell
        # of a shared host falls on both; the table gives medians and the rounds' ratios
        speeds = {"blocks": [blk.get("tok_s")], "replay": [rep.get("tok_s")],
                  "llama.cpp": [ref.get("tok_s")]}
        for rnd in range(1, a.rounds):
            for tag, spec in (("blocks", dict(base, impl="toygraph", base_memory="auto")),
                              ("replay", dict(base, impl="toygraph", base_memory="auto",
                                              replay="engine")),
                              ("llama.cpp", dict(base, impl="llama.cpp"))):
                speeds[tag].append(run_child_here(spec, work, f"{name}-gen-{tag}-{rnd}").get("tok_s"))
        f32.pop("logits", None)
        doc.append({"model": name, "blocks": blk, "replay": rep, "f32": f32, "llama.cpp": ref,
                    "rounds": speeds, "caches": dict(zip(a.caches, caches))})
        if (any("error" in r for r in (f32, blk, rep, ref))
                or None in speeds["blocks"] + speeds["replay"] + speeds["llama.cpp"]):
            lines.append(f"| {name} | " + " | ".join(r.get("error", "ok")[:50]
                                                     for r in (blk, rep, f32, ref))
                         + " | | | | | | |")
            continue
        same = blk["ids"] == f32["ids"]
        rep_first = next((i for i, (x, y) in enumerate(zip(rep["ids"], f32["ids"])) if x != y), None)
        first = next((i for i, (x, y) in enumerate(zip(blk["ids"], f32["ids"])) if x != y), None)
        theirs_first = next((i for i, (x, y) in enumerate(zip(ref["ids"], f32["ids"])) if x != y), None)
        if same:
            agree = f"yes, all {len(f32['ids'])}"
        else:
            agree = (f"no: from token {first} (f32 margin there {blk['f32_margins'][first]:.2f}, "
                     f"error {blk['row_diffs'][first]:.2f})")
        agree += "; replayed " + (f"from token {rep_first}" if rep_first is not None else "all")
        agree += "; llama.cpp " + (f"from token {theirs_first}" if theirs_first is not None else "all")
        mine, replayed, theirs = (statistics.median(speeds[t])
                                  for t in ("blocks", "replay", "llama.cpp"))

        def spread(tag):
            ratios = [x / y for x, y in zip(speeds[tag], speeds["llama.cpp"])]
            return f" ({min(ratios):.0%}..{max(ratios):.0%})" if len(ratios) > 1 else ""

        lines.append(f"| {name} | {mine:.1f} | {replayed:.1f} | {f32['tok_s']:.1f} | {theirs:.1f} | "
                     f"{mine / theirs:.0%}{spread('blocks')} | "
                     f"{replayed / theirs:.0%}{spread('replay')} | {agree} | "
                     f"{blk['max_logit_diff']:.2f} ({rep['max_logit_diff']:.2f}; "
                     f"{ref.get('max_logit_diff', float('nan')):.2f}; {blk['logit_scale']:.1f}) | "
                     f"{blk.get('rollouts_tok_s', float('nan')):.1f} "
                     f"({rep.get('rollouts_tok_s', float('nan')):.1f}) | "
                     + " / ".join("—" if c is None else f"{c:.1f}" for c in caches) + " |")
    return "\n".join(lines), {"rows": doc}


# --- rollouts ----------------------------------------------------------------------------------
def section_rollouts(a, work: Path) -> tuple[str, dict]:
    sides = [("this tree", HERE.parent)]
    if a.against:
        ref = work / "against"
        ref.mkdir()
        archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", a.against],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(ref)], input=archive, check=True)
        # pyproject maps toygraph.recipes and toygraph.fixtures to top-level folders; an
        # editable install would import this tree's for them, so the copy links its own
        for sub in ("recipes", "fixtures"):
            if (ref / sub).is_dir() and not (ref / "toygraph" / sub).exists():
                (ref / "toygraph" / sub).symlink_to(ref / sub, target_is_directory=True)
        sides.append((a.against, ref))
    lines = [f"| model | toygraph | one sequence: tok/s | rollouts, group of {a.group}: tok/s "
             f"| rollouts / one sequence | rollouts after the prefill: tok/s | after the "
             f"prefill / one sequence |", "|---|---|---:|---:|---:|---:|---:|"]
    doc = []
    for name in a.models_gen:
        spec = dict(gguf=str(model_file(name)), threads=a.threads_n, new=a.new, impl="toygraph",
                    base_memory="auto", replay="engine", rollouts=a.group)
        runs = {side: [] for side, _ in sides}
        for rnd in range(a.rounds):   # the sides alternate, so a slow spell falls on both
            for side, root in sides:
                got = run_child_here(spec, work, f"{name}-rollouts-{len(doc)}-{rnd}-{side[:8]}",
                                     root)
                runs[side].append({k: got.get(k) for k in
                                   ("tok_s", "rollouts_tok_s", "rollouts_after_prefill_tok_s",
                                    "error")})
        doc.append({"model": name, "runs": runs})
        for side, _ in sides:
            rs = runs[side]
            if any(r["error"] or r["rollouts_tok_s"] is None for r in rs):
                lines.append(f"| {name} | {side} | {(rs[0]['error'] or 'failed')[:60]} | | | | |")
                continue
            one, roll, after = (statistics.median(r[k] for r in rs) for k in
                                ("tok_s", "rollouts_tok_s", "rollouts_after_prefill_tok_s"))
            lines.append(f"| {name} | {side} | {one:.1f} | {roll:.1f} | {roll / one:.2f}x | "
                         f"{after:.1f} | {after / one:.2f}x |")
    return "\n".join(lines), {"rows": doc}


# --- contention --------------------------------------------------------------------------------
def busy_loop() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def section_contention(a, work: Path) -> tuple[str, dict]:
    import multiprocessing as mp
    path = model_file("smollm2")
    ns = argparse.Namespace(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=16, alpha=32.0,
                            seed=42, init_scale=0.01, warmup=1, steps=3, batch=4, seq=64)
    make_inputs(work, path, ns)
    base = dict(device="cpu", gguf=str(path), seq=64, batch=4, targets=list(ns.targets), rank=16,
                alpha=32.0, lr=1e-3, clip=1.0, seed=42, init_scale=0.01, dtype="f32",
                adapter_dir=str(work / "adapter"), adapter_npz=str(work / "adapter.npz"),
                data=str(work / "data.npz"), op_profile=False, hf_dir=None, threads=a.threads,
                mode="full")
    lines = ["| beside the step | toygraph: s/step | slowdown | torch + PEFT: s/step | slowdown |",
             "|---|---:|---:|---:|---:|"]
    doc, alone = [], {}
    for others in (0, 1, 2):
        procs = [mp.Process(target=busy_loop, daemon=True) for _ in range(others)]
        for p in procs:
            p.start()
        try:
            got = {impl: run_child(work, dict(base, impl=impl), f"contention-{impl}-{others}", {})
                   for impl in ("toygraph", "torch-eager")}
        finally:
            for p in procs:
                p.terminate()
        cells = []
        for impl in ("toygraph", "torch-eager"):
            r = got[impl]
            s = statistics.median(r["step_s"][1:]) if "step_s" in r else float("nan")
            alone.setdefault(impl, s)
            cells += [f"{s:.2f}", f"{s / alone[impl]:.2f}x"]
        doc.append({"others": others, **got})
        lines.append(f"| {others} CPU-bound process{'es' if others != 1 else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {"rows": doc}


# --- main --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        spec = json.loads(Path(argv[1]).read_text())
        ensure_toygraph()
        child = child_interleaved if spec.get("kind") == "interleaved" else child_generate
        Path(argv[2]).write_text(json.dumps(child(spec)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="decode,step,interleaved,generate,rollouts,contention")
    ap.add_argument("--models", help="step and generate rows (default: their own lists)")
    ap.add_argument("--threads", type=int, help="default: the CPUs this process may use")
    ap.add_argument("--targets", default="q,k,v,o")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="step: decoded and blocks alternate this many times, times pooled; "
                         "generate: blocks and llama.cpp alternate, medians")
    ap.add_argument("--new", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--group", type=int, default=4, help="GRPO rollouts' group size")
    ap.add_argument("--against", metavar="REV",
                    help="rollouts: also run on this git revision's toygraph, in turn")
    ap.add_argument("--caches", default="64,1200",
                    help="the KV cache lengths (rows) of the replayed generation's speed rows")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    a.caches = [int(c) for c in a.caches.split(",") if c]
    ensure_toygraph()
    from toygraph.cpu import threads
    a.threads_n = threads.resolve(a.threads)
    chosen = a.models.split(",") if a.models else None
    a.models_step, a.models_gen = chosen or STEP_MODELS, chosen or GEN_MODELS
    from toygraph.cpu import engine
    caps = [f"{k}={os.environ[k]}" for k in ISA_CAPS if k in os.environ]
    head = (f"## The CPU engine — {cpu_name()}, {a.threads_n} threads of "
            f"{len(os.sched_getaffinity(0))} CPUs, {time.strftime('%Y-%m-%d')}\n\n"
            f"- `python bench/cpu_engine.py {' '.join(argv)}`\n"
            f"- the engine built for {engine.simd()}"
            + (f"; set: {', '.join(caps)}" if caps else "") + "\n"
            f"- python {platform.python_version()}, "
            f"numpy {np.__version__}, torch {version('torch')}, transformers "
            f"{version('transformers')}, llama-cpp-python {version('llama_cpp_python')}\n")
    parts, doc = [head], {"argv": argv, "threads": a.threads_n}
    sections = {"decode": lambda w: section_decode(a), "step": lambda w: section_step(a, w),
                "interleaved": lambda w: section_interleaved(a, w),
                "generate": lambda w: section_generate(a, w),
                "rollouts": lambda w: section_rollouts(a, w),
                "contention": lambda w: section_contention(a, w)}
    with tempfile.TemporaryDirectory(prefix="cpu_engine.") as tmp:
        for name in a.sections.split(","):
            before = load()
            work = Path(tmp) / name
            work.mkdir()
            text, doc[name] = sections[name](work)
            parts.append(f"### {name} (load average {before} before, {load()} after)\n\n{text}\n")
            print(parts[-1], flush=True)
    if a.md:
        Path(a.md).write_text("\n".join(parts))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
