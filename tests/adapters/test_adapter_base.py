"""An adapter knows its base (issue 46, item 6): a run records the model it trained on
(architecture, a digest of the tensor table, a digest of the 1-D tensors' values, which
every quantization keeps in f32), and eval, generate, export and --adapter-init refuse
another base in one line -- or, with --other-base, apply it with a one-line warning.

The "other base" here is the independent case the check exists for: a model of exactly
the same shapes and types (the same writer, another seed), as a base and its instruct
model are; another quantization of the same weights is the same base."""
import json
import logging

import pytest

from test_run import cfg_for, write_chat_data
from toygraph.cli.main import main
from toygraph.fixtures.tiny_models import MATRIX_ROLES, write_tiny_llama
from toygraph.training.run import run_training


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """A 1-step run on the tiny model, and a model of the same shapes with other weights."""
    root = tmp_path_factory.mktemp("base")
    out = root / "run"
    data = write_chat_data(root / "chat.jsonl")
    assert run_training(cfg_for(tiny_llama, data, out, steps=1, val_split=0.0))["status"] == "completed"
    other = write_tiny_llama(root / "other.gguf", seed=1)
    return tiny_llama, other, out, data, root


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_eval_refuses_another_base_in_one_line(trained, capsys):
    base, other, out, _, _ = trained
    assert main(["eval", "--model", str(base), "--adapter", str(out), "--text", "hello"]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(other), "--adapter", str(out), "--text", "hello"]) == 2
    err = one_error_line(capsys)
    assert "trained on tiny-llama.gguf" in err and "other.gguf" in err and "--other-base" in err


def test_other_base_applies_it_with_a_one_line_warning(trained, capsys, caplog):
    base, other, out, _, _ = trained
    with caplog.at_level(logging.WARNING):
        assert main(["eval", "--model", str(other), "--adapter", str(out), "--text", "hello",
                     "--other-base"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "trained on tiny-llama.gguf" in warnings[0]


def test_another_quantization_of_the_same_weights_is_the_same_base(trained, tmp_path, capsys):
    _, _, out, _, _ = trained
    requantized = write_tiny_llama(tmp_path / "tiny-f16.gguf",
                                   weight_types={r: "f16" for r in MATRIX_ROLES})
    assert main(["eval", "--model", str(requantized), "--adapter", str(out), "--text", "hi"]) == 0


def test_generate_refuses_another_base(trained, capsys):
    _, other, out, _, _ = trained
    assert main(["generate", "--model", str(other), "--adapter", str(out), "--prompt", "hi",
                 "--max-new-tokens", "1"]) == 2
    assert "--other-base" in one_error_line(capsys)


def test_export_refuses_another_base(trained, tmp_path, capsys):
    _, other, out, _, _ = trained
    for adapter in (out, out / "adapter.gguf"):
        assert main(["export", "--model", str(other), "--adapter", str(adapter),
                     "--out", str(tmp_path / "merged.gguf")]) == 2
        assert "--other-base" in one_error_line(capsys)
        assert not (tmp_path / "merged.gguf").exists()


def test_adapter_init_refuses_another_base(trained, tmp_path, capsys):
    _, other, out, data, _ = trained
    argv = ["finetune", "--model", str(other), "--data", str(data), "--adapter-init", str(out),
            "--targets", "q,v", "--rank", "4", "--alpha", "8", "--steps", "1", "--batch", "2",
            "--seq-len", "32", "--val-split", "0", "--quiet"]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 2
    assert "--other-base" in capsys.readouterr().err
    assert main(argv + ["--out", str(tmp_path / "b"), "--other-base"]) == 0
