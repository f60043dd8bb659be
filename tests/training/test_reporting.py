"""``--report-to`` (toygraph/training/reporting.py): a run's TensorBoard files and W&B run
hold the scalars of its events.jsonl."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from test_run import cfg_for, chat_data, events  # noqa: F401 (chat_data: a fixture)
from toygraph.errors import ToygraphError
from toygraph.training import run_training
from toygraph.training.reporting import reporter_names, scalars
from toygraph.training.run_config import RunConfig


def expected(log: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event log as (step, value) by tag, as the reporters name them."""
    out: dict[str, list] = {}
    for e in log:
        found = scalars(e["event"], {k: v for k, v in e.items() if k not in ("event", "time")})
        for tag, value in (found[1].items() if found else ()):
            out.setdefault(tag, []).append((found[0], value))
    return out


def test_scalars_of_events():
    step = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "real_tokens": 40,
            "wall_ms": 20.0, "tokens": 64, "targets": 10, "ok": True, "kind": "x"}
    assert scalars("step", step) == (3, {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/real_tokens": 40.0,
        "train/wall_ms": 20.0, "train/tokens": 64.0, "train/targets": 10.0,
        "train/tokens_per_s": 2000.0})
    assert scalars("eval", {"step": 3, "val_loss": 1.5, "best": True}) == (3, {"eval/val_loss": 1.5})
    assert scalars("checkpoint", {"step": 3, "path": "p"}) is None


def test_names():
    assert reporter_names(()) == [] and reporter_names(["none"]) == []
    assert reporter_names(["tensorboard,tensorboard"]) == ["tensorboard"]
    with pytest.raises(ToygraphError, match="--report-to mlflow: unknown; choose from tensorboard, wandb"):
        reporter_names(["mlflow"])
    assert RunConfig.kind("report_to") is list and RunConfig.default("report_to") == ()


def test_tensorboard_files_hold_the_logged_scalars(tiny_llama, chat_data, tmp_path):  # noqa: F811
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, report_to=("tensorboard",)))
    want = expected(events(out))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/val_loss"} <= set(want)
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(want)
    for tag, values in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert got == [(s, float(np.float32(v))) for s, v in values], tag
    assert len(want["train/loss"]) == 6 and len(want["eval/val_loss"]) == 3   # steps 0, 3, 6


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_the_config_and_the_scalars(tiny_llama, chat_data, tmp_path, monkeypatch):  # noqa: F811
    """A fake ``wandb`` module records the calls: one init per run (config = the options),
    every scalar of the log at its step, one finish; a resumed run continues the same id."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (calls.append(("init", kw)), FakeRun(calls))[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "r"
    cfg = cfg_for(tiny_llama, chat_data, out, report_to=("wandb",))
    run_training(cfg)
    (init, kw), *logs, finish = calls
    assert init == "init" and finish == ("finish",)
    run_id = (out / "wandb" / "toygraph-run-id").read_text()
    assert kw["config"] == cfg.options() and kw["id"] == run_id and kw["resume"] == "allow"
    assert kw["dir"] == str(out) and kw["name"] == "r"
    logged: dict[str, list] = {}
    for _, step, values in logs:
        for tag, value in values.items():
            logged.setdefault(tag, []).append((step, value))
    assert logged == expected(events(out))

    calls.clear()
    run_training(cfg_for(tiny_llama, chat_data, out, report_to=("wandb",), steps=8,
                         resume=str(out), allow_change=("steps",)))
    assert calls[0][1]["id"] == run_id   # the same W&B run, continued
    assert [c[1] for c in calls if c[0] == "log"][-1] == 8


def test_wandb_that_cannot_start_is_one_line(tiny_llama, chat_data, tmp_path, monkeypatch):  # noqa: F811
    fake = types.ModuleType("wandb")

    def init(**kw):
        raise RuntimeError("api_key not configured (no-tty).\nCall wandb.login(key=...)")
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(ToygraphError, match=r"^--report-to wandb: could not start a W&B run: "
                                            r"api_key not configured \(no-tty\). Call "):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "r", report_to=("wandb",)))


def test_wandb_missing_is_one_line(tiny_llama, chat_data, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", None)   # import wandb raises ImportError
    with pytest.raises(ToygraphError, match=r"^--report-to wandb: the wandb package is not "
                                            r"installed \(pip install wandb\)$"):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "r", report_to=("wandb",)))
    assert not (tmp_path / "r").exists()   # refused before the run directory is made


def test_wandb_offline_run(tiny_llama, chat_data, tmp_path, monkeypatch):  # noqa: F811
    """The real package, offline (no network): the run's file records every logged value
    (as the JSON text W&B stores each history value in) under its tag."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):   # not $HOME's
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, report_to=("wandb",)))
    run_id = (out / "wandb" / "toygraph-run-id").read_text()
    [record] = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    data = record.read_bytes()
    for tag, values in expected(events(out)).items():
        assert tag.encode() in data, tag
        if tag in ("train/loss", "eval/val_loss", "train/lr"):
            for _, value in values:
                assert json.dumps(value).encode() in data, (tag, value)
