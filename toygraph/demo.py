"""``toygraph demo``: a short LoRA fine-tune of SmolLM2-135M-Instruct on the CPU.

The shipped capitals set teaches the model to answer country questions as one line of
JSON. The demo prints what the model says before and after, with phrasings that are not
in the training data, and the validation loss as it falls; it ends with the commands that
use the result (chat, merged GGUF export, Ollama).
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

PROMPTS = ["Tell me the capital of Japan.", "What's the capital city of Kenya?",
           "Capital of Norway?"]


def run_demo(out: str = "runs/demo", steps: int = 60, backend: str = "cpu",
             precision: str = "f32") -> int:
    from toygraph.fixtures.smollm2 import smollm2_path
    from .inference import LanguageModel
    from .train import TrainConfig, run_training

    model = str(smollm2_path())
    data = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "capitals.jsonl"
    if not data.is_file():  # installed (non-editable) layout
        from toygraph import fixtures
        data = Path(fixtures.__file__).parent / "data" / "capitals.jsonl"
    print(f"model: {Path(model).name}\ndata:  {data}\n")
    base = LanguageModel(model, backend=backend, precision=precision)
    before = {p: base.generate(p, chat=True, max_new_tokens=24) for p in PROMPTS}
    del base
    t0 = time.perf_counter()
    # LoRA rank, alpha, seed, schedule, clip and val split are TrainConfig's defaults.
    train_cfg = TrainConfig(model=model, data=str(data), out=out, recipe="lora",
                            targets=("q", "k", "v", "o"), steps=steps, batch=8, seq_len=66,
                            lr=3e-3, warmup=5, eval_every=max(1, steps // 3), backend=backend,
                            precision=precision,
                            overwrite=True)  # a demo run replaces the previous demo
    summary = run_training(train_cfg)
    minutes = (time.perf_counter() - t0) / 60
    tuned = LanguageModel(model, adapter_dir=out, backend=backend,
                          precision=precision)
    evals = [json.loads(l) for l in (Path(out) / "events.jsonl").read_text().splitlines()]
    curve = [f"{e['val_loss']:.3f}@{e['step']}" for e in evals if e["event"] == "eval"]
    print(f"\nfine-tune: {summary['steps']} steps in {minutes:.1f} min; "
          f"validation loss {' -> '.join(curve)}")
    print(f"adapter: {out}/adapter_model.safetensors (PEFT) and {out}/adapter.gguf (llama.cpp)\n")
    for p in PROMPTS:
        print(f"Q: {p}\n  before: {before[p]!r}\n  after:  {tuned.generate(p, chat=True, max_new_tokens=24)!r}")
    print("\nuse the result:")
    for command, why in next_steps(out):
        print(f"  {command}\n      # {why}")
    return 0


def next_steps(out: str, model: str = "smollm2") -> list[tuple[str, str]]:
    """The commands that use a finished run directory ``out``, each with what it is for."""
    # quoted so that a run directory with spaces stays one argument when pasted
    run_dir, merged, modelfile = (shlex.quote(str(p)) for p in
                                  (out, Path(out) / "merged.gguf", Path(out) / "Modelfile"))
    return [
        (f"toygraph chat --model {model} --adapter {run_dir}",
         "talk to the fine-tuned model here (/reset, /exit)"),
        (f"toygraph export --model {model} --adapter {run_dir} --out {merged}",
         "one self-contained GGUF with the adapter merged in (llama.cpp, LM Studio, Ollama)"),
        (f"ollama create capitals -f {modelfile} && ollama run capitals",
         "Ollama: the base GGUF plus adapter.gguf, as the Modelfile beside it says"),
    ]
