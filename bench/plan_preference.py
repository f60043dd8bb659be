"""Planned memory of one DPO or ORPO step, with the per-token log-probs through the fused
head (``linear_cross_entropy(..., reduction="none")``, what recipes/preference.py builds where
``recipes.base.fused_head`` says so: always on CUDA) and through the unfused head
(``token_logprobs`` of [2 * batch * seq_len, vocab] logits, what it built before).

Nothing is allocated or run: the graph is built and planned as realize would (the
numpy backend's f32 itemsize is the CUDA one too), and for CUDA the device allocations
(toygraph.cuda.devmem: arena, pinned, block-format consts, one scratch buffer that every
node needing scratch shares) are planned. The scratch column gives the shared buffer (the
largest node's need) and, in brackets, the sum of the nodes' needs; the last column is
what CUDA held before the nodes shared it, one buffer per node: resident - max + sum.

    python bench/plan_preference.py --recipe dpo --batch 2 --seq-len 512      # SmolLM2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import plan_only_session  # noqa: E402

MIB = 1 << 20


def plan(model, recipe_name: str, batch: int, seq_len: int, fused: bool) -> dict:
    import toygraph.recipes.base as recipe_base
    import toygraph.recipes.preference as preference
    from toygraph.cuda.devmem import plan_device_memory
    from toygraph.recipes import RecipeOptions, recipe_class
    recipe_base.Session = plan_only_session()
    preference.fused_head = lambda backend: fused
    recipe = recipe_class(recipe_name)(targets=("q", "v"), rank=8, alpha=16)
    recipe.realize(model, model.config, RecipeOptions(seq_len=seq_len, batch=batch,
                                                      backend="cuda"))
    sess = recipe.sess
    outputs = [t for ts in recipe.graph.outputs.values() for t in ts]
    mem = plan_device_memory(sess.schedules["step"], sess.plan, sess.pinned, outputs)
    ops = [t.op for t in sess.schedules["step"]]
    per_node = mem.resident_bytes - mem.scratch_bytes + sum(mem.scratch.values())
    return {"fused": fused, "arena_bytes": sess.plan.arena_bytes,
            "per_node_scratch_resident_bytes": per_node,
            "scratch_need_sum_bytes": sum(mem.scratch.values()),
            "pinned_bytes": sess.plan.pinned_bytes, "device": mem.report(),
            "head_ops": {op: ops.count(op) for op in ("token_logprobs", "linear_cross_entropy")}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="GGUF path or 'smollm2'")
    ap.add_argument("--recipe", choices=["dpo", "orpo"], default="dpo")
    ap.add_argument("--batch", type=int, default=2, help="pairs per step (2 x rows)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    from toygraph.models.catalog import resolve_model
    from toygraph.models.model import GGUFModel
    model = GGUFModel(resolve_model(a.model))
    rows = [plan(model, a.recipe, a.batch, a.seq_len, fused) for fused in (False, True)]
    print(f"## {a.recipe} step, {Path(resolve_model(a.model)).name}, batch {a.batch} pairs "
          f"({2 * a.batch} rows) x seq_len {a.seq_len}, LoRA q,v r8: planned memory (nothing "
          f"run)\n\n| log-probs head | arena MiB | CUDA scratch MiB, shared (sum of needs) | "
          f"CUDA resident MiB | before: scratch per node |\n|---|---|---|---|---|")
    for r in rows:
        d = r["device"]
        print(f"| {'fused (linear_cross_entropy none)' if r['fused'] else 'unfused (token_logprobs)'}"
              f" | {r['arena_bytes'] / MIB:.1f} | {d['scratch_bytes'] / MIB:.1f} "
              f"({r['scratch_need_sum_bytes'] / MIB:.1f}) | {d['resident_bytes'] / MIB:.1f} | "
              f"{r['per_node_scratch_resident_bytes'] / MIB:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
