"""One name and one default per setting, from the CLI down to the backend (issue 12 item 4).

A default written twice drifts; these tests fail when a flag's default or a layer's
default stops being the one its dataclass field holds.
"""
from __future__ import annotations

import dataclasses

import pytest

from toygraph.cli import build_parser, main
from toygraph.training.run_config import TrainConfig
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.models.decoder import LoraConfig
from toygraph.recipes import LoRA, RecipeOptions
from toygraph.core.session import Session
from toygraph.core.precision import PRECISIONS
REQUIRED = ["--model", "m.gguf", "--data", "d.jsonl", "--out", "o"]


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def test_every_finetune_flag_defaults_to_its_trainconfig_field():
    args = build_parser().parse_args(["finetune", *REQUIRED])
    checked = 0
    for name, default in _defaults(TrainConfig).items():
        if not hasattr(args, name):
            continue   # an option without a flag (min_lr, beta1, ...)
        got = getattr(args, name)
        if name == "targets":
            got = tuple(got.split(","))
        elif name == "allow_change":
            got = tuple(x for x in got.split(",") if x)
        assert got == default, f"--{name.replace('_', '-')} defaults to {got!r}, field {default!r}"
        checked += 1
    assert checked >= 25   # the test really walked the flags


def test_trainconfig_reads_its_defaults_from_the_lower_layers():
    t, r, lora = _defaults(TrainConfig), _defaults(RecipeOptions), _defaults(LoraConfig)
    shared = set(t) & set(r)
    assert shared >= {"seq_len", "batch", "seed", "init_scale", "clip", "grad_accum",
                      "backend", "precision"}
    for name in shared:
        assert t[name] == r[name], name
    for name in ("targets", "rank", "alpha"):
        assert t[name] == lora[name], name
    assert (r["seed"], r["init_scale"]) == (lora["seed"], lora["init_scale"])
    recipe = LoRA()
    assert (recipe.targets, recipe.rank, recipe.alpha) == (lora["targets"], lora["rank"],
                                                           lora["alpha"])


def test_model_commands_default_to_the_recipe_backend_and_precision():
    parser = build_parser()
    for argv in (["eval", "--model", "m", "--text", "x"],
                 ["generate", "--model", "m", "--prompt", "x"],
                 ["chat", "--model", "m"], ["demo"], ["finetune", *REQUIRED]):
        args = parser.parse_args(argv)
        assert (args.backend, args.precision) == (RecipeOptions.backend, RecipeOptions.precision)


def test_precision_reaches_the_session_and_is_refused_on_the_cpu():
    """--precision becomes TrainConfig.precision, RecipeOptions.precision and
    Session(precision=); the numpy backend computes f32 matmuls only."""
    args = build_parser().parse_args(["finetune", *REQUIRED, "--precision", "bf16",
                                      "--backend", "cuda"])
    assert args.precision == "bf16"
    assert RecipeOptions(precision="tf32", backend="cuda").precision == "tf32"
    assert Session(Graph(), backend="cpu", precision="f32").backend.name == "cpu"
    for p in PRECISIONS[1:]:
        with pytest.raises(GraphError, match=f"precision '{p}'.*needs the cuda backend"):
            Session(Graph(), backend="cpu", precision=p)
        with pytest.raises(GraphError, match="RecipeOptions.precision"):
            RecipeOptions(precision=p)
    with pytest.raises(SystemExit):   # argparse names the choices
        build_parser().parse_args(["finetune", *REQUIRED, "--precision", "f16"])


def test_precision_on_the_cpu_is_a_one_line_cli_error(tmp_path, capsys):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")   # never read: the options are checked first
    for argv in (["finetune", "--data", "d.jsonl", "--out", str(tmp_path / "o")],
                 ["eval", "--text", "x"]):
        code = main([*argv, "--model", str(model), "--precision", "bf16"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "--precision 'bf16'" in err and "needs the cuda backend" in err, err


def test_f64_buffers_are_a_separate_cpu_setting():
    """dtype (the float type of every buffer, f64 for gradient checks) is not precision."""
    import numpy as np
    s = Session(Graph(), backend="cpu", dtype="f64")
    assert s.backend.dtype == np.float64
    with pytest.raises(GraphError, match="dtype must be f32 or f64"):
        Session(Graph(), backend="cpu", dtype="bf16")
