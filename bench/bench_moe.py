"""A LoRA step (q,k,v,o, the default recipe otherwise) on a random Qwen3-30B-A3B-shaped
GGUF (bench/random_model.py, Q4_K_M's block types) on the CPU: tokens/s, peak RSS, and the
bytes of the file a step actually reads, with the base kept quantized (the experts a
step's tokens chose are decoded one at a time, ops/experts/) against decoded.

Bytes read: before a measured "cold" step the child drops the file from its mapping
(madvise MADV_DONTNEED on toygraph's mmap) and from the page cache (posix_fadvise
DONTNEED); after the step it asks the kernel which of the file's pages are resident
(mincore on its own mapping of the file). Resident pages are what the step read (plus
the kernel's read-ahead of faulted pages); /proc/self/pagemap says which pages of
toygraph's own mapping the step touched. Per expert slice of the _exps tensors it reports
both, split into the slices the block kernel decoded (the experts the step's tokens
chose) and the others. toygraph's expert kernel advises the expert tensors MADV_RANDOM (BlockTensor.read_sparsely);
a second row skips that advice to show what the disk's read-ahead costs.

Each mode runs in its own child process (its peak RSS is its own). The decode mode's
plan is computed from the quantized one (same arena, the block consts as f32) and run
only with --ab-layers, on a shallower file of the same shapes.

    python bench/bench_moe.py --layers 6 --ab-layers 1 --seq 32 \
        --md bench/results/moe-....md --json bench/results/moe-....json
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import mmap
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_base_memory import finish, uptime  # noqa: E402
from bench_lora import bench_cache, ensure_toygraph, log, peak_rss_bytes  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def model_file(n_layer: int) -> Path:
    from random_model import QWEN3_30B_A3B, write_random_qwen3moe
    path = bench_cache() / "qwen3moe-30b-a3b-shape" / f"random-{n_layer}l-q4_k_m.gguf"
    if not path.is_file():
        log(f"writing {path} (random, {n_layer} layers; once)")
        write_random_qwen3moe(path, **dict(QWEN3_30B_A3B, n_layer=n_layer))
    return path


def resident(path: Path) -> np.ndarray:
    """One bool per page of ``path``: in the page cache now (mincore on a fresh mapping)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, np.uint8)
    try:
        vec = np.zeros((size + PAGE - 1) // PAGE, np.uint8)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                         vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return (vec & 1).astype(bool)
    finally:
        del view
        mm.close()


def mapped(model) -> np.ndarray:
    """One bool per page of toygraph's own mapping of the file: present in this process's
    page tables (/proc/self/pagemap bit 63), i.e. touched since the last evict (plus the
    kernel's fault-around of already cached neighbours, 64 KiB by default)."""
    mm = model.reader.mmap
    start, n = mm.ctypes.data // PAGE, (mm.nbytes + PAGE - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = np.frombuffer(f.read(n * 8), np.uint64)
    return (entries >> np.uint64(63)).astype(bool)


def default_readahead(decode) -> None:
    """Keep the disk's read-ahead over the _exps tensors: the expert kernel's
    madvise(MADV_RANDOM) (BlockTensor.read_sparsely) becomes a no-op, so a page fault there
    reads the read-ahead window, as before that advice."""
    decode.BlockTensor.read_sparsely = lambda self: None


def evict(model, path: Path) -> None:
    """Drop the file's pages from toygraph's mapping and from the page cache."""
    model.reader.mmap._mmap.madvise(mmap.MADV_DONTNEED)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def page_bytes(pages: np.ndarray, start: int, n: int) -> int:
    """Resident bytes of [start, start + n) counted by whole pages."""
    a, b = start // PAGE, (start + n + PAGE - 1) // PAGE
    return int(pages[a:b].sum()) * PAGE


# --- the child: realize, warm up, one cold step, warm steps ------------------------------------
def child(spec: dict) -> dict:
    ensure_toygraph()
    from toygraph.core.optimizer import hp_row
    from toygraph.cpu import block_tensor as decode
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions

    path = Path(spec["gguf"])
    model = GGUFModel(path)
    t0 = time.perf_counter()
    recipe = LoRA(targets=("q", "k", "v", "o"))
    recipe.realize(model, model.config, RecipeOptions(seq_len=spec["seq"], batch=spec["batch"],
                                                      seed=0))
    plan = recipe.sess.plan
    out = {"realize_s": time.perf_counter() - t0, "summary": plan.summary(),
           "plan_total": plan.total_bytes, "base_memory": plan.base_memory}
    if plan.base_memory == "quantized":  # what decode mode's plan would hold
        f32 = sum(4 * t.size for t in recipe.graph.nodes if t.id in plan.quantized)
        out["decode_plan_total"] = plan.total_bytes - plan.base_bytes - plan.scratch_bytes + f32

    decoded: list[tuple[str, int, int]] = []   # (tensor, expert, bytes) the kernel decoded
    plain_part = decode.BlockTensor.part
    names = {id(recipe.sess.backend.arrays[t.id]): t.name for t in recipe.graph.nodes
             if t.id in plan.quantized}

    plain_decode = decode.BlockTensor.decode_into

    def part(self, i):
        p = plain_part(self, i)
        p.tag = (names[id(self)], int(i))
        return p

    def decode_into(self, out):
        if hasattr(self, "tag"):
            decoded.append((*self.tag, self.nbytes))
        return plain_decode(self, out)

    decode.BlockTensor.part = part
    decode.BlockTensor.decode_into = decode_into
    rng = np.random.default_rng(1)
    B, T, n = spec["batch"], spec["seq"], 2 + spec["warm_steps"]
    ids = rng.integers(0, model.config.n_vocab, size=(n, 1, B, T), dtype=np.int32)
    labels = np.concatenate([ids[..., 1:], np.full((n, 1, B, 1), -1, np.int32)], axis=-1)
    pos = np.tile(np.arange(T, dtype=np.int32), (1, B, 1))
    tensors = {t.name: (t.data_offset, int(t.n_bytes)) for t in model.reader.tensors}
    if spec["readahead"]:
        default_readahead(decode)
    losses, warm_s = [], []
    for i in range(n):
        cold = i == 1
        if cold:
            evict(model, path)
            before = resident(path)
        decoded.clear()
        ts = time.perf_counter()
        losses.append(recipe.step(ids[i], pos, labels[i], hp_row(i + 1, 1e-3), is_first=i == 0))
        dt = time.perf_counter() - ts
        log(f"{spec['mode']} step {i + 1}/{n}{' (cold)' if cold else ''}: "
            f"loss {losses[-1]:.6f} {dt:.2f} s")
        if i >= 2:
            warm_s.append(dt)
        if cold:
            out["cold_s"] = dt
            out.update(read_report(resident(path), mapped(model), tensors, decoded,
                                   model.config.n_expert))
            out["resident_before"] = int(before.sum()) * PAGE
            out["decoded_expert_bytes"] = int(sum(b for _, _, b in decoded))
            out["decoded_expert_slices"] = len(decoded)
    out.update(losses=[x.hex() for x in losses], warm_s=warm_s, peak_rss=peak_rss_bytes(),
               tokens=B * T)
    return out


def read_report(cached, touched, tensors, decoded, n_expert) -> dict:
    """What the cold step brought into the page cache (``cached``, mincore) and touched
    through toygraph's mapping (``touched``, pagemap): in all, and per expert slice of the
    _exps tensors, split by whether the block kernel decoded that expert this step."""
    chosen = {(name, e) for name, e, _ in decoded}
    count = {"decoded": [0, 0, 0], "unused": [0, 0, 0]}   # slices, cached >50%, touched >0
    unused_cached = unused_touched = 0
    for name, (off, n) in tensors.items():
        if "_exps" not in name:
            continue
        per = n // n_expert
        for e in range(n_expert):
            c = page_bytes(cached, off + e * per, per)
            t = page_bytes(touched, off + e * per, per)
            row = count["decoded" if (name, e) in chosen else "unused"]
            row[0] += 1
            row[1] += c > per / 2
            row[2] += t > 0
            if (name, e) not in chosen:
                unused_cached += c
                unused_touched += t
    exps = sum(n for name, (_, n) in tensors.items() if "_exps" in name)
    return {"cached_after": int(cached.sum()) * PAGE, "touched": int(touched.sum()) * PAGE,
            "expert_bytes": exps, "slices": count, "unused_expert_cached_bytes": unused_cached,
            "unused_expert_touched_bytes": unused_touched}


def run_child(spec: dict) -> dict:
    env = {**os.environ, "TOYGRAPH_BASE_MEMORY": spec["mode"]}
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                       capture_output=True, text=True)
    sys.stderr.write(r.stderr[-4000:])
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"refused": tail}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ab-layers", type=int, default=1,
                    help="depth of the file decode vs quantized run on (0: none)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warm-steps", type=int, default=1)
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    load = [uptime()]
    rows = []
    common = dict(seq=a.seq, batch=a.batch, warm_steps=a.warm_steps)
    path = model_file(a.layers)
    for readahead in (False, True):
        rows.append(dict(layers=a.layers, size=path.stat().st_size, mode="quantized",
                         readahead=readahead,
                         **run_child(dict(common, gguf=str(path), mode="quantized",
                                          readahead=readahead))))
    if a.ab_layers:
        small = model_file(a.ab_layers)
        for mode in ("quantized", "decode"):
            rows.append(dict(layers=a.ab_layers, size=small.stat().st_size, mode=mode,
                             readahead=False,
                             **run_child(dict(common, gguf=str(small), mode=mode,
                                              readahead=False))))
    load.append(uptime())
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python bench/bench_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           "uptime": load, "rows": rows}
    finish(render(doc), a, doc)


def render(doc: dict) -> str:
    lines = [f"# LoRA step on a random Qwen3-30B-A3B-shaped GGUF (CPU, {doc['date']})", "",
             f"command: `{doc['command']}`  ", f"machine: {doc['machine']}  ",
             f"load (uptime) before/after: `{doc['uptime'][0]}` / `{doc['uptime'][1]}`", "",
             "| layers | file GiB | base | experts madvise | tokens/s (warm) | cold step s | "
             "peak RSS GiB | cold step: page cache MiB | touched via mapping MiB | "
             "decoded expert slices: cached / touched | unused slices: cached / touched | "
             "unused expert MiB cached / touched | decoded expert MiB | decode plan GiB |",
             "|" + "---|" * 14]
    for r in doc["rows"]:
        if "refused" in r:
            lines.append(f"| {r['layers']} | {r['size'] / GIB:.2f} | {r['mode']} | "
                         f"refused: {r['refused']} |" + " |" * 10)
            continue
        tps = r["tokens"] / (sum(r["warm_s"]) / len(r["warm_s"])) if r["warm_s"] else float("nan")
        d, u = r["slices"]["decoded"], r["slices"]["unused"]
        lines.append(
            f"| {r['layers']} | {r['size'] / GIB:.2f} | {r['base_memory']} | "
            f"{'normal (undone)' if r['readahead'] else 'random (toygraph)'} | {tps:.2f} | {r['cold_s']:.1f} | "
            f"{r['peak_rss'] / GIB:.2f} | {r['cached_after'] / MIB:.0f} | {r['touched'] / MIB:.0f} | "
            f"{d[0]}: {d[1]} / {d[2]} | {u[0]}: {u[1]} / {u[2]} | "
            f"{r['unused_expert_cached_bytes'] / MIB:.0f} / {r['unused_expert_touched_bytes'] / MIB:.0f} | "
            f"{r['decoded_expert_bytes'] / MIB:.0f} | "
            f"{r.get('decode_plan_total', r['plan_total']) / GIB:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
