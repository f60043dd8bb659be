"""Runs that cannot change anything say so (issue 46, item 7): an adapter whose every
gradient is zero for the whole run (``--init-scale 0``: A and B both start at zero, so
neither gets a gradient; GRPO whose groups' rewards never differ: no advantage) ends
"unchanged" with one warning line, no top-level result and a non-zero exit; and
``generate`` refuses a model whose numbers are not finite, as ``eval`` does."""
import json

import numpy as np
import pytest

from test_grpo import cfg as grpo_cfg, write_prompts
from test_run import cfg_for, events, write_chat_data
from toygraph.cli.main import main
from toygraph.fixtures.tiny_models import write_tiny_llama
from toygraph.training.run import run_training


def test_a_zero_initialised_adapter_ends_unchanged(tiny_llama, tmp_path):
    data, out = write_chat_data(tmp_path / "chat.jsonl"), tmp_path / "run"
    summary = run_training(cfg_for(tiny_llama, data, out, steps=3, val_split=0.0, init_scale=0.0))
    assert summary["status"] == "unchanged"
    assert "every gradient of the run's 3 steps was zero" in summary["reason"]
    assert "--init-scale 0" in summary["reason"]
    assert not (out / "adapter_model.safetensors").exists()
    assert [e["status"] for e in events(out) if e["event"] == "run_end"] == ["unchanged"]


def test_the_same_run_with_an_init_scale_completes(tiny_llama, tmp_path):
    """The control: only the zero init made the run above a no-op."""
    data, out = write_chat_data(tmp_path / "chat.jsonl"), tmp_path / "run"
    summary = run_training(cfg_for(tiny_llama, data, out, steps=3, val_split=0.0))
    assert summary["status"] == "completed" and (out / "adapter_model.safetensors").exists()


def test_the_command_line_warns_in_one_line_and_exits_non_zero(tiny_llama, tmp_path, capsys):
    data, out = write_chat_data(tmp_path / "chat.jsonl"), tmp_path / "run"
    rc = main(["finetune", "--model", str(tiny_llama), "--data", str(data), "--out", str(out),
               "--steps", "2", "--batch", "2", "--seq-len", "32", "--val-split", "0",
               "--init-scale", "0", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 4
    lines = [line for line in err.splitlines() if "unchanged" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: run unchanged: ")


def test_grpo_whose_rewards_never_differ_ends_unchanged(tiny_llama, tmp_path):
    """Every completion passes ``length:0:100000``: each group's rewards are equal."""
    prompts, out = write_prompts(tmp_path), tmp_path / "g"
    summary = run_training(grpo_cfg(tiny_llama, prompts, out, steps=2,
                                    reward=("length:0:100000",)))
    assert summary["status"] == "unchanged"
    assert "no group's rewards differed" in summary["reason"]


def test_generate_refuses_a_model_whose_numbers_are_not_finite(tmp_path, capsys):
    bad = write_tiny_llama(tmp_path / "nan.gguf", std=float("nan"))
    assert main(["eval", "--model", str(bad), "--text", "hello"]) == 2
    eval_err = capsys.readouterr().err
    assert main(["generate", "--model", str(bad), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("toygraph generate: error: ")
    shared = "the model computes values that are not finite numbers"
    assert shared in eval_err and shared in err
