"""Which elementwise chains are left in the steps the CPU engine replays: is there anything
for a fused elementwise kernel to take?

    python bench/studies/elementwise_chains.py            # the golden experiments
    python bench/studies/elementwise_chains.py --demo     # and the demo's step on SmolLM2

Beside the golden experiments (Llama, Qwen2, SmolLM2: LoRA, full, scratch, DPO, ORPO,
packed, recomputed), a two-step LoRA run on every projection of each tiny family the
package writes (Qwen3, Gemma 3, Llama 3), on 16 instruction rows.

A chain here is two elementwise nodes where the second reads the first's result and
nothing else does: the pair a fused kernel could compute in one pass without writing the
intermediate. Every phase each experiment compiles (training steps, evaluation, the
optimizer) is counted, and per experiment the elementwise nodes, the pairs by op, and the
elements those pairs would no longer write. Counts only: how long the elementwise kernels
take is ``bench/demo_profile.py``'s table.
"""
from __future__ import annotations

import argparse
import collections
import os

#: The elementwise family's ops (ops/elementwise/cpu.py) and the gradient accumulation.
ELEMENTWISE = {"add", "sub", "mul", "scale", "swiglu_oai", "swiglu_oai_back", "accumulate"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", action="store_true", help="also one step of toygraph demo's recipe")
    args = ap.parse_args(argv)
    os.environ["TOYGRAPH_CPU_REPLAY"] = "engine"
    from toygraph.core import numpy_backend
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    from toygraph.ops.elementwise.cpu import ACTIVATIONS
    elementwise = ELEMENTWISE | set(ACTIVATIONS)
    seen: dict = {}
    compile_phase = numpy_backend.CpuBackend._compile

    def counting(self, nodes):
        order = [t for t in nodes if t.op is not None]
        readers = collections.Counter(s.id for t in order for s in t.srcs)
        made = {t.id: t for t in order}
        seen["nodes"] += len(order)
        for t in order:
            if t.op not in elementwise:
                continue
            seen["elementwise"] += 1
            for s in t.srcs:
                first = made.get(s.id)
                if first is not None and first.op in elementwise and readers[s.id] == 1:
                    seen["pairs"][f"{first.op} -> {t.op}"] += 1
                    seen["elements"] += first.size
        return compile_phase(self, nodes)

    numpy_backend.CpuBackend._compile = counting
    runs = [(name, lambda name=name: run_experiment(EXPERIMENTS[name])) for name in EXPERIMENTS]
    runs += [(f"lora all tiny {family}", lambda family=family: _tiny_family(family))
             for family in ("qwen3", "gemma3", "llama3")]
    if args.demo:
        runs.append(("demo step (SmolLM2)", _demo_step))
    print("| experiment | nodes compiled | elementwise nodes | chained pairs | elements not written |")
    print("|---|---:|---:|---|---:|")
    for name, run in runs:
        seen.update(nodes=0, elementwise=0, pairs=collections.Counter(), elements=0)
        run()
        pairs = ", ".join(f"{k} x{v}" for k, v in sorted(seen["pairs"].items())) or "none"
        print(f"| {name} | {seen['nodes']} | {seen['elementwise']} | {pairs} | {seen['elements']} |")
    return 0


def _tiny_family(family: str):
    import json
    import tempfile
    from pathlib import Path
    from toygraph.fixtures import tiny_models
    from toygraph.training import RunConfig, run_training
    with tempfile.TemporaryDirectory() as tmp:
        model = getattr(tiny_models, f"write_tiny_{family}")(Path(tmp) / f"{family}.gguf")
        data = Path(tmp) / "rows.jsonl"
        data.write_text("".join(json.dumps({"instruction": f"say {i}", "response": f"it is {i}"})
                                + "\n" for i in range(16)))
        run_training(RunConfig(model=str(model), data=str(data), out=str(Path(tmp) / "run"),
                               targets=("q", "k", "v", "o", "gate", "up", "down"), steps=2,
                               batch=2, seq_len=32, quiet=True), show_use=False)


def _demo_step():
    from toygraph.demo import capitals
    from toygraph.models.catalog import smollm2_path
    from toygraph.training import RunConfig, run_training
    run_training(RunConfig(model=str(smollm2_path()), data=capitals.data_files(),
                           out="/tmp/toygraph-elementwise-chains", recipe="lora", steps=1,
                           overwrite=True, quiet=True, **capitals.RECIPE), show_use=False)


if __name__ == "__main__":
    raise SystemExit(main())
