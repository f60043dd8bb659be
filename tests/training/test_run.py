"""The fine-tuning loop end to end on a tiny model: events, checkpoints, resume, adapters."""
import json
import os
import signal

import numpy as np
import pytest

from toygraph.errors import DataError, ToygraphError
from toygraph.training import RunConfig, run_training

TEXTS = ["the cat sat on the mat and the dog sat on the log",
         "an owl is a bird that hunts at night in the woods",
         "the sun is hot and the moon is cold and far away"]


def write_chat_data(p):
    """24 instruction rows "say i" -> "the number is i"."""
    rows = [{"instruction": f"say {i}", "response": f"the number is {i}"} for i in range(24)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


@pytest.fixture
def chat_data(tmp_path):
    return write_chat_data(tmp_path / "chat.jsonl")


def events(out):
    return [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]


def cfg_for(model, data, out, **kw):
    base = dict(model=str(model), data=str(data), out=str(out), targets=("q", "v"), rank=4,
                alpha=8, steps=6, batch=2, seq_len=32, lr=5e-3, val_split=0.25, eval_every=3,
                quiet=True, seed=7)
    base.update(kw)
    if base.get("recipe") in ("full", "scratch"):   # they train every weight: no adapter shape
        for name in ("targets", "rank", "alpha"):
            base.pop(name)
    return RunConfig(**base)


def test_run_writes_events_checkpoints_and_adapters(tiny_llama, chat_data, tmp_path):
    out = tmp_path / "run"
    summary = run_training(cfg_for(tiny_llama, chat_data, out, save_every=3))
    assert summary["status"] == "completed" and summary["steps"] == 6
    ev = events(out)
    kinds = [e["event"] for e in ev]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    steps = [e for e in ev if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7))
    for e in steps:
        assert {"loss", "lr", "grad_norm", "tokens", "wall_ms"} <= set(e)
        assert np.isfinite(e["loss"]) and e["grad_norm"] > 0
    evals = [e for e in ev if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 3, 6] and all("perplexity" in e for e in evals)
    assert ev[0]["data_hash"] and ev[0]["versions"]["toygraph"]
    for name in ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf"):
        assert (out / name).is_file()
    assert (out / "checkpoints" / "step-000003" / "optimizer.safetensors").is_file()
    assert (out / "best" / "trainable.safetensors").is_file()


def test_instruction_loss_falls(tiny_llama, chat_data, tmp_path):
    run_training(cfg_for(tiny_llama, chat_data, tmp_path / "r", steps=30, lr=2e-2,
                         val_split=0.0, targets=("q", "k", "v", "o", "gate", "up", "down")))
    losses = [e["loss"] for e in events(tmp_path / "r") if e["event"] == "step"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_two_runs_are_bit_identical(tiny_llama, chat_data, tmp_path):
    runs = []
    for name in ("a", "b"):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / name))
        runs.append([e["loss"] for e in events(tmp_path / name) if e["event"] == "step"])
    assert runs[0] == runs[1]


def test_resume_continues_exactly(tiny_qwen2, chat_data, tmp_path):
    """6 steps straight == 3 steps, stop, resume from the checkpoint, 3 more steps."""
    kw = dict(steps=6, save_every=3, grad_accum=2, targets=("q", "k", "v", "o", "gate", "up", "down"))
    run_training(cfg_for(tiny_qwen2, chat_data, tmp_path / "full", **kw))
    straight = [e["loss"] for e in events(tmp_path / "full") if e["event"] == "step"]
    # The first half: the same run, stopped by Ctrl-C after step 3 (its checkpoint is
    # what we resume from).
    part = tmp_path / "part"
    _stop_after(cfg_for(tiny_qwen2, chat_data, part, **kw), 3)
    resumed = cfg_for(tiny_qwen2, chat_data, part, resume=str(part / "checkpoints" / "step-000003"), **kw)
    run_training(resumed)
    losses = {}
    for e in events(part):
        if e["event"] == "step":
            losses[e["step"]] = e["loss"]
    assert [losses[s] for s in range(1, 7)] == straight


def _stop_after(cfg, n):
    """Run ``cfg`` but raise KeyboardInterrupt (Ctrl-C) right after step ``n``."""
    import toygraph.training.run as tr
    real = tr.EventLog.write

    def write(self, event, **fields):
        real(self, event, **fields)
        if event == "step" and fields["step"] == n:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, mid-run
    tr.EventLog.write = write
    try:
        summary = run_training(cfg)
    finally:
        tr.EventLog.write = real
    assert summary["status"] == "interrupted" and summary["steps"] == n


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tiny_llama, chat_data, tmp_path):
    cfg = cfg_for(tiny_llama, chat_data, tmp_path / "r", steps=6, val_split=0.0)
    _stop_after(cfg, 2)
    ck = tmp_path / "r" / "checkpoints" / "step-000002"
    assert (ck / "state.json").is_file() and json.loads((ck / "state.json").read_text())["step"] == 2
    assert events(tmp_path / "r")[-1] == {**events(tmp_path / "r")[-1], "event": "run_end",
                                          "status": "interrupted"}


def test_plain_text_trains_on_every_token(tiny_llama, tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    run_training(cfg_for(tiny_llama, data, tmp_path / "r", val_split=0.0, steps=2))
    start = events(tmp_path / "r")[0]
    rep = start["data_report"]
    assert rep["target_tokens"] == rep["total_tokens"] - rep["kept"]  # all but each first token


def test_full_and_scratch_recipes_write_weights(tiny_llama, chat_data, tmp_path):
    for recipe in ("full", "scratch"):
        out = tmp_path / recipe
        s = run_training(cfg_for(tiny_llama, chat_data, out, recipe=recipe, steps=2, val_split=0))
        assert s["status"] == "completed" and (out / "weights.safetensors").is_file()


def test_bad_inputs_give_clear_errors(tiny_llama, chat_data, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl"):
        run_training(cfg_for(tiny_llama, empty, tmp_path / "a"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2|line 2"):
        run_training(cfg_for(tiny_llama, bad, tmp_path / "b"))
    with pytest.raises(ToygraphError, match="context length"):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "c", seq_len=4096))
    with pytest.raises(ToygraphError, match="LoRA targets"):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "d", targets=("q", "wq")))
    with pytest.raises(ToygraphError, match="no such|not found|No such"):
        run_training(cfg_for(tmp_path / "missing.gguf", chat_data, tmp_path / "e"))
    with pytest.raises(DataError, match="not a checkpoint"):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "f", resume=str(tmp_path)))


def test_early_stopping_and_loss_plot(tiny_llama, chat_data, tmp_path):
    """A learning rate too high to settle makes validation worse at some point (but not
    so high that the divergence guard stops the run); patience 1 stops the run."""
    out = tmp_path / "r"
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=40, lr=0.5,
                             eval_every=2, patience=1, schedule="constant"))
    assert s["status"] == "early_stopped" and s["steps"] < 40
    evals = [e for e in events(out) if e["event"] == "eval"]
    assert not evals[-1]["best"]
    pytest.importorskip("matplotlib")
    assert (out / "loss.png").stat().st_size > 1000


def test_adapter_init_starts_from_a_saved_adapter(tiny_llama, chat_data, tmp_path):
    from toygraph.inference.language_model import LanguageModel
    first = tmp_path / "first"
    run_training(cfg_for(tiny_llama, chat_data, first, steps=4, val_split=0.0, lr=2e-2))
    # Evaluate the saved adapter on the first training batch of a new run ...
    second = tmp_path / "second"
    run_training(cfg_for(tiny_llama, chat_data, second, steps=1, val_split=0.0,
                         adapter_init=str(first), lr=1e-12, seed=9))
    step1 = [e for e in events(second) if e["event"] == "step"][0]["loss"]
    fresh = tmp_path / "fresh"
    run_training(cfg_for(tiny_llama, chat_data, fresh, steps=1, val_split=0.0, lr=1e-12, seed=9))
    step1_fresh = [e for e in events(fresh) if e["event"] == "step"][0]["loss"]
    # ... it must differ from a fresh adapter's, and the saved adapter must be what loaded.
    assert step1 != step1_fresh
    lm = LanguageModel(str(tiny_llama), adapter_dir=str(second))
    lm_first = LanguageModel(str(tiny_llama), adapter_dir=str(first))
    ids = list(range(3, 20))
    assert lm.loss(ids)[0] == pytest.approx(lm_first.loss(ids)[0], rel=1e-6)


def test_a_run_leaves_no_session_alive_when_it_returns(tiny_llama, chat_data, tmp_path, monkeypatch):
    """The run's session (its arena of GiBs on a real model) sits in reference cycles;
    run_training collects them before it returns, so the caller's next work (the demo's
    questions, an evaluation) does not hold it too. The collector is off while the run
    runs, so only run_training's own collection can free it."""
    import gc
    import weakref
    from toygraph.core.session import Session
    made, init = [], Session.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Session, "__init__", spy)
    enabled = gc.isenabled()
    gc.disable()
    try:
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "run", steps=2))
        alive = [ref for ref in made if ref() is not None]
    finally:
        if enabled:
            gc.enable()
    assert made and not alive


def test_the_end_of_run_report_starts_after_the_training_session_is_gone(
        tiny_llama, chat_data, tmp_path, monkeypatch):
    """The fidelity line at the end of a LoRA run builds a model per block type; the
    training's session is freed before it (not after the run), so the two never stack.
    The collector is off, so only the run's own collection can free it."""
    import gc
    import weakref
    from toygraph.core.session import Session
    from toygraph.training import run
    made, seen, init = [], [], Session.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    def report(run_cfg, prep, out):
        seen.append(sum(ref() is not None for ref in made))
        return "fidelity: (a stand-in)"

    monkeypatch.setattr(Session, "__init__", spy)
    monkeypatch.setattr(run, "end_of_run_fidelity", report)
    enabled = gc.isenabled()
    gc.disable()
    try:
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "run", steps=2, quiet=False))
    finally:
        if enabled:
            gc.enable()
    assert made and seen == [0]
