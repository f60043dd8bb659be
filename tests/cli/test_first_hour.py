"""A new user's first hour (issue 27): checks before the model loads, progress and Ctrl-C,
which adapter is final, and the small things a first run meets."""
from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from toygraph.cli import main
from toygraph.errors import DataError, GGUFError
from toygraph.training import RunConfig, run_training
from toygraph.training.checkpoints import step_dir_name
from toygraph.training.run_dir import RunError
from toygraph.training.supervisor import Progress, duration_text, rate_text


def _data(tmp_path, n=8):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Colour {i}?", "response": c}) + "\n"
                            for i, c in enumerate(["red", "green", "blue", "teal"] * (n // 4))))
    return data


# --- everything that needs no model is checked first ----------------------------------------------
def test_what_needs_no_model_fails_before_the_model_loads(tiny_llama, tmp_path, monkeypatch):
    import toygraph.training.prepare as prepare

    def never(*a, **k):
        raise AssertionError("the model was loaded before a check that needs none")
    monkeypatch.setattr(prepare, "GGUFModel", never)
    data = _data(tmp_path)
    base = dict(model=str(tiny_llama), data=str(data), out=str(tmp_path / "o"), quiet=True)
    with pytest.raises(DataError, match="nope.jsonl"):
        run_training(RunConfig(**{**base, "data": str(tmp_path / "nope.jsonl")}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        run_training(RunConfig(**{**base, "data": str(bad)}))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "events.jsonl").write_text("")
    with pytest.raises(RunError, match="holds a run; pass --resume"):
        run_training(RunConfig(**base))
    with pytest.raises(GGUFError, match="no such GGUF file"):
        run_training(RunConfig(**{**base, "model": str(tmp_path / "none.gguf")}))
    with pytest.raises(DataError, match="no such adapter directory"):
        run_training(RunConfig(**{**base, "out": str(tmp_path / "p"),
                                  "adapter_init": str(tmp_path / "gone")}))


def test_the_first_lines_say_what_loads_then_the_settings(tiny_llama, tmp_path, capsys):
    run_training(RunConfig(model=str(tiny_llama), data=str(_data(tmp_path)),
                           out=str(tmp_path / "r"), steps=2, batch=2, seq_len=32, val_split=0,
                           rank=2))
    err = capsys.readouterr().err
    order = [err.index(s) for s in ("loading tiny-llama.gguf (", "settings (* = not the default",
                                    "tokenizing 8 rows", "building the training step",
                                    "step     1/2")]
    assert order == sorted(order), err


# --- progress --------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_lines_say_elapsed_eta_and_a_readable_rate():
    clock, out = Clock(), io.StringIO()
    p = Progress(100, quiet=False, stream=out, clock=clock, tty=False, every_s=10)
    for t in range(1, 101):
        clock.now += 0.5
        p.update(t, 1.0 / t, 7.25)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step     1/100") and "7.25 tok/s" in lines[0]
    assert "0:00 elapsed, 0:49 left" in lines[0]   # 0.5 s a step, 99 to go
    assert len(lines) == 21 and "0:50 elapsed, 0:00 left" in lines[-1]   # 1st, every 5%
    assert (rate_text(1234.4), rate_text(56.78), rate_text(0.4217)) == ("1,234", "56.8", "0.42")
    assert duration_text(3725) == "1:02:05"


def test_a_slow_run_prints_at_least_every_few_seconds_and_quiet_prints_nothing():
    clock, out = Clock(), io.StringIO()
    p = Progress(1000, quiet=False, stream=out, clock=clock, tty=False, every_s=10)
    for t in range(1, 6):
        clock.now += 11   # steps slower than every_s: every one is shown
        p.update(t, 1.0, 3.0)
    assert len(out.getvalue().splitlines()) == 5
    quiet = io.StringIO()
    Progress(10, quiet=True, stream=quiet).update(1, 1.0, 1.0)
    assert quiet.getvalue() == ""


def test_on_a_terminal_the_line_is_redrawn_and_a_long_step_shows_it_runs():
    out = io.StringIO()
    p = Progress(3, quiet=False, stream=out, tty=True, every_s=0.05)
    p.update(1, 2.0, 10.0)
    assert out.getvalue().startswith("\rstep     1/3 [") and not out.getvalue().endswith("\n")
    p.step_begins()
    time.sleep(0.3)                      # the step runs: the heartbeat redraws the line
    p.update(2, 1.5, 10.0)
    p.update(3, 1.0, 10.0)
    p.close()
    text = out.getvalue()
    assert "(step running 0:00)" in text and text.endswith("\n")


# --- Ctrl-C -----------------------------------------------------------------------------------
def test_ctrl_c_is_acknowledged_at_once_and_ends_with_the_resume_command(tiny_llama, tmp_path):
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "toygraph.cli", "finetune", "--model", str(tiny_llama),
           "--data", str(_data(tmp_path, 16)), "--out", str(out), "--steps", "100000",
           "--batch", "2", "--seq-len", "32", "--rank", "2", "--val-split", "0",
           "--save-minutes", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = ""
    while not line.startswith("step "):   # the first progress line: steps are running
        line = proc.stderr.readline()
        assert line, "the run ended before its first step"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    ack = proc.stderr.readline()
    while not ack.strip():
        ack = proc.stderr.readline()
    waited = time.monotonic() - sent
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert ack.startswith("SIGINT: stopping after step ") and "checkpoints/step-" in ack, ack
    assert waited < 1.0, f"acknowledged after {waited:.2f}s"
    assert "run interrupted" in rest and f"--resume {out}" in rest, rest
    assert f"--config {out / 'run.yaml'}" in rest


# --- which adapter is final ------------------------------------------------------------------
def test_the_final_adapter_is_the_best_by_default_with_a_validation_split(tiny_llama, tmp_path,
                                                                         capsys):
    data = _data(tmp_path, 16)
    common = dict(model=str(tiny_llama), data=str(data), steps=6, batch=2, seq_len=32,
                  rank=2, lr=5e-2, val_split=0.25, eval_every=1, seed=3)
    best = run_training(RunConfig(out=str(tmp_path / "best"), **common))
    assert best["final"]["from"] == "best"
    top = load_file(str(tmp_path / "best" / "adapter_model.safetensors"))
    kept = load_file(str(tmp_path / "best" / "best" / "adapter_model.safetensors"))
    assert top.keys() == kept.keys() and all(np.array_equal(top[k], kept[k]) for k in top)
    err = capsys.readouterr().err
    assert "final adapter:" in err and "toygraph chat --model" in err
    last = run_training(RunConfig(out=str(tmp_path / "last"), final="last", quiet=True, **common))
    assert last["final"] == {"from": "last", "step": 6}
    top = load_file(str(tmp_path / "last" / "adapter_model.safetensors"))
    step6 = load_file(str(tmp_path / "last" / "checkpoints" / step_dir_name(6) /
                          "adapter_model.safetensors"))
    assert all(np.array_equal(top[k], step6[k]) for k in top)


# --- the small things ------------------------------------------------------------------------
def test_files_follow_the_umask(tiny_llama, tmp_path):
    old = os.umask(0o022)
    try:
        run_training(RunConfig(model=str(tiny_llama), data=str(_data(tmp_path)),
                               out=str(tmp_path / "r"), steps=1, batch=2, seq_len=32,
                               val_split=0, rank=2, quiet=True))
    finally:
        os.umask(old)
    for name in ("adapter_model.safetensors", "adapter.gguf", "run.yaml", "Modelfile"):
        assert stat.S_IMODE((tmp_path / "r" / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE((tmp_path / "r" / "checkpoints" / step_dir_name(1)).stat().st_mode) == 0o755


def test_version_export_report_and_generation_speed(tiny_llama, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip().startswith("toygraph 0.")
    run_training(RunConfig(model=str(tiny_llama), data=str(_data(tmp_path)),
                           out=str(tmp_path / "r"), steps=1, batch=2, seq_len=32, val_split=0,
                           rank=2, quiet=True))
    assert main(["export", "--model", str(tiny_llama), "--adapter", str(tmp_path / "r"),
                 "--out", str(tmp_path / "m.gguf"), "--type", "q8_0"]) == 0
    said = capsys.readouterr().out
    assert "MiB): tiny-llama.gguf with the adapter" in said and "rank 2" in said
    assert "stored as q8_0" in said and "chat template gguf" in said
    assert main(["generate", "--model", str(tiny_llama), "--prompt", "Hello",
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "tokens/s) after a" in err
    with pytest.raises(DataError, match="no such adapter directory"):
        from toygraph.adapters.files import load_peft
        from toygraph.models.model import GGUFModel
        load_peft(tmp_path / "r" / "checkpoints" / step_dir_name(99), GGUFModel(tiny_llama).config)


def test_long_work_reports_its_progress_and_short_work_stays_quiet(tiny_llama, tmp_path):
    from toygraph.data import encode_dataset, load_examples
    from toygraph.gguf.tokenizer import Tokenizer
    from toygraph.training.supervisor import Ticker
    clock, said = Clock(), []
    tick = Ticker("tokenizing, row", said.append, every_s=5, clock=clock)
    for done in range(0, 100, 10):
        clock.now += 1            # 1 s a tenth: a line every 5 s of work
        tick(done, 100)
    assert said == ["tokenizing, row: 40 of 100 (40%), 0:05 elapsed, 0:07 left",
                    "tokenizing, row: 90 of 100 (90%), 0:10 elapsed, 0:01 left"]
    calls = []
    encode_dataset(load_examples(_data(tmp_path)), Tokenizer.from_gguf(tiny_llama), 32,
                   progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 8) for i in range(8)]
