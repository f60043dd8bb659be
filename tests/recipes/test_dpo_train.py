"""DPO and ORPO runs end to end on a tiny model with the shipped preference fixture:
metrics in events and on the progress line, validation on held-out pairs, the adapter
exported and loaded for generation, resume bit-exact, --adapter-init as the reference,
and the CLI flags."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_run import _stop_after, events
from toygraph.demo.capitals import data_path as capitals_data
from toygraph import cli
from toygraph.errors import ToygraphError
from toygraph.inference.language_model import LanguageModel
from toygraph.training import RunConfig, run_training

PREFERENCES = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "preferences.jsonl"
CAPITALS = capitals_data()
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def cfg_for(model, out, **kw):
    base = dict(model=str(model), data=str(PREFERENCES), out=str(out), recipe="dpo",
                targets=("q", "v"), rank=4, alpha=8, steps=4, batch=2, seq_len=96, lr=2e-2,
                val_split=0.25, eval_every=2, quiet=True, seed=3, max_examples=16, beta=0.5)
    base.update(kw)
    if base["recipe"] == "lora":   # the SFT run before DPO: no preference strength
        base.pop("beta")
    return RunConfig(**base)


def steps_of(out):
    return [e for e in events(out) if e["event"] == "step"]


@pytest.mark.parametrize("recipe", ["dpo", "orpo"])
def test_run_logs_metrics_validates_on_pairs_and_writes_the_adapter(tiny_llama, tmp_path, recipe,
                                                                    capsys):
    out = tmp_path / recipe
    summary = run_training(cfg_for(tiny_llama, out, recipe=recipe, quiet=False))
    assert summary["status"] == "completed" and summary["steps"] == 4
    for e in steps_of(out):
        assert set(METRICS) <= set(e) and np.isfinite(e["loss"]) and e["grad_norm"] > 0
        assert 0 <= e["rewards/accuracy"] <= 1
        assert abs(e["rewards/margin"] - (e["rewards/chosen"] - e["rewards/rejected"])) < 1e-9
    evals = [e for e in events(out) if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(e["pairs"] == 4 and {f"val_{k}" for k in METRICS} <= set(e) for e in evals)
    if recipe == "dpo":  # before any update the policy is the reference
        assert evals[0]["val_rewards/margin"] == 0 and evals[0]["val_loss"] == pytest.approx(np.log(2))
    assert "margin" in capsys.readouterr().err
    for name in ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf", "Modelfile"):
        assert (out / name).is_file()
    lm = LanguageModel(str(tiny_llama), adapter_dir=str(out))
    base = LanguageModel(str(tiny_llama))
    ids = list(range(3, 30))
    assert lm.loss(ids)[0] != base.loss(ids)[0]  # the exported adapter is what trained
    # Generation runs with it (a smoke check: the tiny model's words mean nothing).
    assert isinstance(lm.generate("What is the capital of Peru?", chat=True, max_new_tokens=5), str)


def test_resume_continues_exactly(tiny_llama, tmp_path):
    """4 steps straight == 2 steps, Ctrl-C, resume, 2 more: the same losses and metrics,
    and the same final adapter bytes."""
    kw = dict(steps=4, save_every=2, grad_accum=2, val_split=0.0)
    run_training(cfg_for(tiny_llama, tmp_path / "full", **kw))
    part = tmp_path / "part"
    _stop_after(cfg_for(tiny_llama, part, **kw), 2)
    run_training(cfg_for(tiny_llama, part, resume=str(part), **kw))
    by_step = {e["step"]: e for e in steps_of(part)}
    for e in steps_of(tmp_path / "full"):
        assert {k: by_step[e["step"]][k] for k in ("loss", *METRICS)} == \
               {k: e[k] for k in ("loss", *METRICS)}
    for name in ("adapter_model.safetensors", "adapter.gguf"):
        assert (part / name).read_bytes() == (tmp_path / "full" / name).read_bytes()


def test_adapter_init_is_the_frozen_reference(tiny_llama, tmp_path):
    """DPO from an SFT adapter: at step 1 the policy equals the reference (base + that
    adapter), so every reward is exactly 0 and the loss is log 2; training then moves it."""
    sft = tmp_path / "sft"
    run_training(cfg_for(tiny_llama, sft, recipe="lora", data=str(CAPITALS), steps=3,
                         val_split=0.0))
    out = tmp_path / "dpo"
    run_training(cfg_for(tiny_llama, out, adapter_init=str(sft), val_split=0.0, steps=3))
    first, *rest = steps_of(out)
    assert all(first[k] == 0 for k in METRICS[:3]) and first["loss"] == pytest.approx(np.log(2))
    assert rest[-1]["rewards/margin"] != 0


def test_resume_keeps_the_reference_adapter(tiny_llama, tmp_path):
    """The reference model is base + the --adapter-init adapter, so a resumed DPO run must
    get the same adapter back (by content; the path may move) or be refused."""
    from toygraph.training.resume import ResumeMismatch
    sfts = []
    for seed in (1, 2):
        sfts.append(tmp_path / f"sft{seed}")
        run_training(cfg_for(tiny_llama, sfts[-1], recipe="lora", data=str(CAPITALS), steps=2,
                             val_split=0.0, seed=seed))
    out = tmp_path / "dpo"
    kw = dict(steps=2, save_every=1, val_split=0.0)
    run_training(cfg_for(tiny_llama, out, adapter_init=str(sfts[0]), **kw))
    ckpt = out / "checkpoints" / "step-000001"
    for other in (str(sfts[1]), None):
        with pytest.raises(ResumeMismatch, match="--adapter-init was an adapter with sha256"):
            run_training(cfg_for(tiny_llama, tmp_path / "r", adapter_init=other, resume=str(ckpt), **kw))
    moved = tmp_path / "moved"
    shutil.copytree(sfts[0], moved)
    run_training(cfg_for(tiny_llama, tmp_path / "r2", adapter_init=str(moved), resume=str(ckpt), **kw))
    assert [e["loss"] for e in steps_of(tmp_path / "r2")] == [e["loss"] for e in steps_of(out)][1:]


def test_cli_flags_and_errors(tiny_llama, tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli.main(["finetune", "--model", str(tiny_llama), "--data", str(PREFERENCES),
                     "--out", str(out), "--recipe", "dpo", "--beta", "0.3", "--label-smoothing",
                     "0.1", "--steps", "1", "--batch", "2", "--seq-len", "96", "--max-examples",
                     "4", "--val-split", "0", "--rank", "4", "--quiet"])
    assert code == 0 and json.loads(capsys.readouterr().out)["status"] == "completed"
    start = events(out)[0]["config"]
    assert (start["recipe"], start["beta"], start["label_smoothing"]) == ("dpo", 0.3, 0.1)
    for kw, needle in ((dict(recipe="orpo", label_smoothing=0.1), "--label-smoothing is for --recipe dpo, not orpo"),
                       (dict(beta=0.0), "--beta must be a finite number > 0"),
                       (dict(label_smoothing=0.5), "--label-smoothing must be a finite number"),
                       (dict(data=str(CAPITALS)), "not a preference row")):
        with pytest.raises(ToygraphError, match=needle):
            run_training(cfg_for(tiny_llama, tmp_path / "bad", **kw))
