"""Real (non-padding) tokens per second with and without sample packing.

The same LoRA training steps on the same ragged instruct data (the shipped
fixtures/data/ragged_alpaca.jsonl, 300 alpaca-style rows of ~40-360 SmolLM2 tokens, made by
fixtures/make_ragged.py), once one example per row (padded to --seq-len) and once packed
(toygraph.data.packing: first-fit decreasing, attention kept inside each example). Each mode
runs --warmup untimed steps, then --steps timed ones; "real tok/s" counts only the slots
that hold an example's token. Prints one markdown table (stdout); ``--json`` writes the rows.

    python bench/bench_packing.py --backend cpu --seq-len 512 --batch 4 --steps 3
    python bench/bench_packing.py --backend cuda --seq-len 2048 --batch 4 --steps 10 --warmup 2
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

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "fixtures" / "data" / "ragged_alpaca.jsonl"


def run_mode(model, tok, items, args, pack: bool) -> dict:
    """Realize the LoRA recipe for one mode and time its steps."""
    from toygraph.data.batches import pad_id_for
    from toygraph.core.optimizer import hp_row
    from toygraph.data.packing import batches_per_epoch, epoch_batches, packing_efficiency
    from toygraph.recipes import LoRA, RecipeOptions
    recipe = LoRA(targets=tuple(args.targets.split(",")), rank=8, alpha=16)
    t0 = time.perf_counter()
    recipe.realize(model, model.config, RecipeOptions(seq_len=args.seq_len, batch=args.batch,
                                                      backend=args.backend, pack=pack, seed=0))
    realize_s = time.perf_counter() - t0
    n = args.warmup + args.steps
    bs, epoch = [], 0
    while len(bs) < n:   # as many epochs as the steps need (packed epochs are short)
        bs += epoch_batches(items, args.batch, args.seq_len, pad_id_for(tok), pack=pack,
                            shuffle=True, seed=0, epoch=epoch)
        epoch += 1
    times, real, slots, losses = [], 0, 0, []
    for i, b in enumerate(bs[:n]):
        seg = None if b.segments is None else b.segments[None]
        t = time.perf_counter()
        losses.append(recipe.step(b.tokens[None], b.positions[None], b.labels[None],
                                  hp_row(i + 1, 1e-4), is_first=i == 0, segments=seg))
        dt = time.perf_counter() - t
        print(f"{'packed' if pack else 'unpacked'} step {i + 1}/{n}: {dt:.2f} s, "
              f"{b.real_tokens} real tokens", file=sys.stderr, flush=True)
        if i >= args.warmup:
            times.append(dt)
            real += b.real_tokens
            slots += b.tokens.size
    eff = packing_efficiency(items, args.batch, args.seq_len)
    total = sum(times)
    return {"pack": pack, "seq_len": args.seq_len, "batch": args.batch, "backend": args.backend,
            "epoch_efficiency": eff["packed" if pack else "unpacked"],
            "timed_efficiency": real / slots,
            "batches_per_epoch": batches_per_epoch(items, args.batch, args.seq_len, pack),
            "step_s": total / len(times), "real_tok_s": real / total, "slot_tok_s": slots / total,
            "steps": len(times), "realize_s": round(realize_s, 2),
            "arena_bytes": recipe.sess.plan.arena_bytes, "losses": losses}


def table(doc: dict) -> str:
    """The markdown table of one run (``--json``'s document)."""
    a, rows = doc["args"], doc["rows"]
    out = [f"## packing: {doc['model']}, LoRA {a['targets']}, {a['backend']}, batch {a['batch']} "
           f"x seq_len {a['seq_len']}, {a['steps']} timed steps after {a['warmup']} warmup\n",
           f"{doc['utc']} UTC, {doc['node']}, {doc['cores']} cores, load average "
           f"{doc['load_avg']:.1f} at the end. {doc['report']}. {a['note']}\n",
           "| mode | real tokens / slots (epoch) | timed steps' | step s | real tok/s | "
           "slot tok/s | arena MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {'packed' if r['pack'] else 'one example per row'} | "
                   f"{r['epoch_efficiency']:.1%} ({r['batches_per_epoch']} batches) | "
                   f"{r['timed_efficiency']:.1%} | {r['step_s']:.2f} | {r['real_tok_s']:.3g} | "
                   f"{r['slot_tok_s']:.3g} | {r['arena_bytes'] / 2 ** 20:.0f} |")
    out.append(f"\npacked / unpacked real tok/s: **{doc['speedup']:.2f}x**")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="GGUF path or 'smollm2' (cached)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--targets", default="q,v")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--note", default="", help="a line for the table (e.g. machine load)")
    args = ap.parse_args(argv)
    from toygraph.models.catalog import resolve_model
    from toygraph.data.batches import encode_dataset, load_examples
    from toygraph.models.model import GGUFModel
    from toygraph.gguf.tokenizer import Tokenizer
    path = resolve_model(args.model)
    model, tok = GGUFModel(path), Tokenizer.from_gguf(path)
    enc = encode_dataset(load_examples(args.data), tok, args.seq_len)
    rows = [run_mode(model, tok, enc.items, args, pack) for pack in (False, True)]
    speedup = rows[1]["real_tok_s"] / rows[0]["real_tok_s"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    doc = {"rows": rows, "speedup": speedup, "load_avg": load, "args": vars(args),
           "model": Path(path).name, "report": str(enc.report), "node": platform.node(),
           "cores": os.cpu_count(), "utc": f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M}"}
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
