"""``toygraph demo``: a short LoRA fine-tune of SmolLM2-135M-Instruct on the CPU.

The shipped capitals set teaches the model to answer country questions as one line of
JSON. The demo prints what the model says before and after, with phrasings that are not
in the training data, and the validation loss as it falls.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

PROMPTS = ["Tell me the capital of Japan.", "What's the capital city of Kenya?",
           "Capital of Norway?"]


def run_demo(out: str = "runs/demo", steps: int = 60, backend: str = "cpu") -> int:
    from toygraph.fixtures.smollm2 import smollm2_path
    from .inference import LanguageModel
    from .train import TrainConfig, run_training

    model = str(smollm2_path())
    data = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "capitals.jsonl"
    if not data.is_file():  # installed (non-editable) layout
        from toygraph import fixtures
        data = Path(fixtures.__file__).parent / "data" / "capitals.jsonl"
    print(f"model: {Path(model).name}\ndata:  {data}\n")
    base = LanguageModel(model, backend=backend)
    before = {p: base.generate(p, chat=True, max_new_tokens=24) for p in PROMPTS}
    del base
    t0 = time.perf_counter()
    cfg = TrainConfig(model=model, data=str(data), out=out, recipe="lora",
                      targets=("q", "k", "v", "o"), rank=8, alpha=16, steps=steps, batch=8,
                      seq_len=66, lr=3e-3, schedule="cosine", warmup=5, clip=1.0,
                      val_split=0.1, eval_every=max(1, steps // 3), seed=42, backend=backend,
                      overwrite=True)  # a demo run replaces the previous demo
    summary = run_training(cfg)
    minutes = (time.perf_counter() - t0) / 60
    tuned = LanguageModel(model, adapter_dir=out, backend=backend)
    evals = [json.loads(l) for l in (Path(out) / "events.jsonl").read_text().splitlines()]
    curve = [f"{e['val_loss']:.3f}@{e['step']}" for e in evals if e["event"] == "eval"]
    print(f"\nfine-tune: {summary['steps']} steps in {minutes:.1f} min; "
          f"validation loss {' -> '.join(curve)}")
    print(f"adapter: {out}/adapter_model.safetensors (PEFT) and {out}/adapter.gguf (llama.cpp)\n")
    for p in PROMPTS:
        print(f"Q: {p}\n  before: {before[p]!r}\n  after:  {tuned.generate(p, chat=True, max_new_tokens=24)!r}")
    return 0
