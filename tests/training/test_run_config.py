"""The run configuration, declared once (toygraph/training/run_config.py, run_file.py): the finetune
flags made from it, the YAML run file, the run.yaml a run directory keeps, the resume
rules, and the defaults it reads from the lower layers."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import numpy as np
import pytest
import yaml

from toygraph.cli import build_parser, main
from toygraph.cli.finetune import run_config_from_args
from toygraph.core.graph import Graph
from toygraph.precision import PRECISIONS
from toygraph.core.session import Session
from toygraph.errors import GraphError, ToygraphError
from toygraph.models.decoder import LoraConfig
from toygraph.recipes import RECIPES, LoRA, RecipeOptions
from toygraph.training import RunConfig, run_training
from toygraph.training.resume import OPERATIONAL, SHAPE
from toygraph.training.run_config import flag
from toygraph.training.run_file import RUN_FILE, load_run_file, settings_block, write_run_file



@pytest.fixture
def required(tmp_path):
    """The three required flags (the model must be a file: its name is resolved)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    return ["--model", str(model), "--data", "d.jsonl", "--out", "o"]


def _parsed(*argv):
    return build_parser().parse_args(["finetune", *argv])


# --- the flags come from the fields -------------------------------------------------------------
def test_every_option_has_a_flag_with_help_and_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "--config RUN.yaml YAML run file" in text
    text = text[text.index("what to train:"):]    # the options, after the usage line
    for name in RunConfig.names():
        default = RunConfig.default(name)
        shown = ("required" if default is dataclasses.MISSING else "none" if default is None
                 else ",".join(default) if isinstance(default, tuple) else str(default))
        m = re.search(rf"{re.escape(flag(name))}\b[^-]*?.*?\(default: ([^)]*)\)", text)
        assert m, f"{flag(name)} has no help with its default"
        assert m.group(1) == (shown or "none"), (name, m.group(1), shown)


def test_the_flags_give_the_fields_defaults(required):
    cfg = run_config_from_args(_parsed(*required))
    for name in RunConfig.names():
        if RunConfig.default(name) is not dataclasses.MISSING:
            assert getattr(cfg, name) == RunConfig.default(name), name
    assert (cfg.model, cfg.data, cfg.out) == (required[1], ("d.jsonl",), "o")


def test_flags_parse_into_the_fields_types(required):
    cfg = run_config_from_args(_parsed(*required, "--targets", "q, k,v", "--rank", "4", "--lr",
                                       "2e-3", "--pack", "--allow-change", "seq-len,lr",
                                       "--no-quiet", "--epochs", "1.5"))
    assert (cfg.targets, cfg.rank, cfg.lr, cfg.pack, cfg.quiet, cfg.epochs) == \
        (("q", "k", "v"), 4, 2e-3, True, False, 1.5)
    assert cfg.allow_change == ("seq_len", "lr")


def test_a_missing_required_option_is_one_line(tmp_path, capsys):
    assert main(["finetune", "--data", "d.jsonl", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("toygraph finetune: error: --model is required (on the command line or as "
                   "`model:` in a --config run file)")


def test_recipe_choices_are_the_registered_recipes(required):
    assert RunConfig.choices("recipe") == tuple(RECIPES)
    with pytest.raises(SystemExit):
        _parsed(*required, "--recipe", "nope")


def test_an_option_a_recipe_does_not_use_is_refused():
    base = dict(model="m", data="d", out="o")
    for kw, needle in ((dict(recipe="full", rank=4), "--rank is for --recipe lora, dpo, orpo, grpo, not full"),
                       (dict(beta=0.3), "--beta is for --recipe dpo, orpo, not lora"),
                       (dict(recipe="dpo", pack=True), "--pack is for --recipe lora, full, scratch, not dpo")):
        with pytest.raises(ToygraphError, match=re.escape(needle)):
            RunConfig(**base, **kw).validate()
    RunConfig(**base, recipe="full").validate()          # defaults are never in the way


# --- each recipe declares its own options -------------------------------------------------------
def _names(options) -> set[str]:
    return {f.name for f in dataclasses.fields(options)}


def test_a_recipe_takes_exactly_the_options_it_declares():
    """RunConfig declares what every run takes; each recipe's Options (declared beside it)
    the rest. No option is declared twice, each recipe uses exactly its Options' fields
    and an adapter recipe's Options are the adapter options'."""
    from toygraph.recipes.options import AdapterOptions
    shared = {n for n in RunConfig.names() if RunConfig.for_every_recipe(n)}
    assert {"model", "data", "out", "lr", "steps", "seq_len"} <= shared
    declared = set()
    for name, cls in RECIPES.items():
        own = _names(cls.Options)
        assert not own & shared, (name, own & shared)
        assert own <= set(RunConfig.names()), name
        assert issubclass(cls.Options, AdapterOptions) == cls.trains_adapter, name
        for option in RunConfig.names():
            assert (name in RunConfig.recipes_using(option)) == (option in shared | own), \
                (name, option)
        declared |= own
    assert declared | shared == set(RunConfig.names())   # no option nobody takes
    assert len(shared) < 50 and "num_generations" not in shared and "dora" not in shared


def test_a_knob_has_one_name_from_the_flag_to_the_kernel():
    """--lora-dropout is LoRA(lora_dropout=), its variants["lora_dropout"] and
    LoraConfig.lora_dropout; GRPO's objective options are Objective's fields by name."""
    import inspect
    from toygraph.recipes.grpo import GRPOOptions
    from toygraph.recipes.grpo_loss import Objective
    from toygraph.recipes.lora import LoRAOptions
    from toygraph.recipes.options import AdapterOptions, PackingOptions
    variants = _names(LoRAOptions) - _names(AdapterOptions) - _names(PackingOptions)
    assert variants == {"rslora", "dora", "lora_plus_ratio", "lora_dropout"}
    assert variants <= {f.name for f in dataclasses.fields(LoraConfig)}
    assert variants <= set(inspect.signature(LoRA).parameters)
    cfg = RunConfig(model="m", data="d", out="o", rslora=True, lora_plus_ratio=2.0,
                    lora_dropout=0.25)
    assert LoRA.from_options(cfg).variants == {n: getattr(cfg, n) for n in variants}
    objective = {f.name for f in dataclasses.fields(Objective)}
    assert objective <= _names(GRPOOptions)
    grpo = RECIPES["grpo"].from_options(RunConfig(model="m", data="d", out="o", recipe="grpo",
                                                  reward=("json",), kl_beta=0.05, epsilon=0.1))
    assert (grpo.objective.kl_beta, grpo.objective.epsilon) == (0.05, 0.1)


def test_a_recipe_whose_options_the_run_lacks_is_one_line():
    from toygraph.recipes.lora import LoRAOptions
    from toygraph.recipes.options import option
    from toygraph.recipes.registry import register

    @dataclasses.dataclass(kw_only=True)
    class WiderOptions(LoRAOptions):
        width: int = option(3, help="a width", group="adapter")

    class Wider(LoRA):
        Options = WiderOptions
    register("wider")(Wider)
    try:
        with pytest.raises(ToygraphError, match=r"--recipe wider: its options \['width'\] are "
                                                r"not run options"):
            RunConfig(model="m", data="d", out="o", recipe="wider").validate()
    finally:
        del RECIPES["wider"]


# --- the run file -----------------------------------------------------------------------------
def test_the_run_file_sets_options_and_flags_override_it(tmp_path):
    run = tmp_path / "run.yaml"
    (tmp_path / "m.gguf").write_bytes(b"")
    run.write_text(f"model: {tmp_path / 'm.gguf'}\ndata: d.jsonl\nout: o\nrank: 4\nlr: 1e-3\n"
                   "targets: [q, v, o]\nseq-len: 64\n")
    cfg = run_config_from_args(_parsed("--config", str(run), "--rank", "2"))
    assert (cfg.rank, cfg.lr, cfg.targets, cfg.seq_len) == (2, 1e-3, ("q", "v", "o"), 64)
    assert load_run_file(run)["lr"] == 1e-3        # YAML reads 1e-3 as text: taken as a number


@pytest.mark.parametrize("text, needle", [
    ("rnak: 4\n", "unknown option 'rnak'; did you mean 'rank'?"),
    ("learning_rate: 4\n", "unknown option 'learning_rate'"),
    ("rank: four\n", "rank: must be an integer >= 1, got 'four'"),
    ("- rank\n", "expected a mapping of option: value"),
    ("rank: [\n", "not valid YAML at line 2"),
])
def test_a_bad_run_file_is_one_line_naming_the_key(tmp_path, capsys, text, needle):
    run = tmp_path / "run.yaml"
    run.write_text(text)
    assert main(["finetune", "--config", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert main(["finetune", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


#: 9 levels of 9 aliases in under 1 KB: 387M strings once expanded, the value of one
#: option (the refusal of its wrong type formatted all of them: minutes and GBs).
BILLION_LAUGHS = "targets: [&a [lol, lol, lol, lol, lol, lol, lol, lol, lol], " + ", ".join(
    f"&{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")) + "]\n"


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.write_text(BILLION_LAUGHS), "YAML aliases expand to more than 100,000 values"),
    (lambda p: p.write_text("rank: " + "[" * 500 + "]" * 500 + "\n"), "nested more than 64 levels"),
    (lambda p: p.write_text("template: '" + "x" * (50 << 20) + "'\n"), "larger than 1 MiB"),
    (lambda p: p.write_text("rank: [" + ", ".join(["9" * 100] * 2000) + "]\n"),
     "must be an integer >= 1, got [99999"),
    (lambda p: os.mkfifo(p), "not a regular file (a FIFO)"),
    (lambda p: None, "not a regular file (a character device)"),   # /dev/zero
], ids=["billion-laughs", "deep", "50MiB-string", "long-list", "fifo", "dev-zero"])
def test_a_hostile_run_file_is_refused_at_once_in_one_bounded_line(tmp_path, capsys, make, needle):
    """A billion-laughs file hung for minutes; a 50 MiB string took 51 s and printed a
    50 MB error line; --config /dev/zero and a FIFO hung."""
    run = tmp_path / "run.yaml"
    make(run)
    t0 = time.perf_counter()
    assert main(["finetune", "--config", str(run) if run.exists() else "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 5, "not refused at once"
    assert err.count("\n") == 1 and len(err) < 500 and needle in err, err[:500]


def test_alpha_is_bounded_where_the_update_would_drown_the_model(tmp_path, capsys, required):
    """--alpha 1e12 trained to val loss 15.7 from 3.56 without a word."""
    RunConfig(model="m", data="d", out="o", alpha=2048, rank=8).validate()   # scale 256: allowed
    assert main(["finetune", *required, "--alpha", "1e12"]) == 2
    err = capsys.readouterr().err
    assert "--alpha 1e+12 with --rank 8 scales the update by 1.25e+11, above 1024" in err, err
    assert main(["finetune", *required, "--alpha", "nan"]) == 2
    assert "--alpha must be a finite number > 0, got nan" in capsys.readouterr().err


def test_run_file_round_trip_keeps_what_the_run_computes(tmp_path):
    cfg = RunConfig(model="m.gguf", data="d.jsonl", out="o", rank=4, targets=("q", "v"),
                    resume="runs/x", allow_change=("lr",), lr=3e-3)
    path = write_run_file(cfg, tmp_path)
    assert path.name == RUN_FILE
    doc = yaml.safe_load(path.read_text())
    assert "resume" not in doc and "allow_change" not in doc and "overwrite" not in doc
    back = load_run_file(path)
    assert back["model"].endswith("m.gguf") and back["model"].startswith("/")
    assert (back["rank"], back["targets"], back["lr"]) == (4, ("q", "v"), 3e-3)


def test_the_settings_block_is_compact_and_marks_changes():
    text = settings_block(RunConfig(model="m", data="d", out="o", rank=4, lr=2e-3))
    assert "rank 4*" in text and "lr 0.002*" in text and "alpha 16.0" in text
    assert "beta " not in text.replace("beta1", "").replace("beta2", "")   # not a dpo run
    assert "resume" not in text and len(text.splitlines()) <= 12


# --- a run driven by a run file, repeated from its run.yaml ---------------------------------------
def _losses(out) -> list[str]:
    return [float(e["loss"]).hex() for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
            if e["event"] == "step"]


def test_a_run_file_drives_finetune_and_run_yaml_repeats_it_bit_for_bit(tiny_llama, tmp_path,
                                                                       capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {w}.", "response": w}) + "\n"
                            for w in ("red", "green", "blue", "amber", "teal", "mauve")))
    run = tmp_path / "mine.yaml"
    run.write_text(f"model: {tiny_llama}\ndata: {data}\nrank: 2\nsteps: 3\nbatch: 2\n"
                   "seq_len: 32\nlr: 5e-3\nval_split: 0\nquiet: true\nseed: 3\n")
    first = tmp_path / "first"
    assert main(["finetune", "--config", str(run), "--out", str(first), "--targets", "q,v,o"]) == 0
    start = json.loads((first / "events.jsonl").read_text().splitlines()[0])
    assert start["config"]["targets"] == ["q", "v", "o"] and start["config"]["rank"] == 2
    kept = yaml.safe_load((first / RUN_FILE).read_text())
    assert kept["targets"] == ["q", "v", "o"] and kept["out"] == str(first)
    again = tmp_path / "again"
    assert main(["finetune", "--config", str(first / RUN_FILE), "--out", str(again)]) == 0
    assert _losses(again) == _losses(first) and len(_losses(first)) == 3
    capsys.readouterr()


def test_the_run_start_prints_the_settings(tiny_llama, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"word {i} " * 8}) + "\n" for i in range(4)))
    run_training(RunConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / "r"),
                           steps=1, batch=2, seq_len=16, val_split=0, rank=2))
    err = capsys.readouterr().err
    assert "settings (* = not the default" in err and "rank 2*" in err and "steps 1*" in err


# --- resume rules and the defaults of the lower layers ------------------------------------------
def test_resume_rules_come_from_the_fields():
    assert SHAPE == {"recipe", "targets", "rank", "dora"}   # dora: the magnitude tensors
    assert {"out", "resume", "model", "data", "quiet", "backend", "adapter_init"} <= OPERATIONAL
    assert not {"lr", "seed", "batch", "seq_len", "schedule", "beta"} & OPERATIONAL


def test_run_config_reads_its_defaults_from_the_lower_layers():
    r, lora = RecipeOptions, LoraConfig
    for name in ("seq_len", "batch", "seed", "init_scale", "clip", "grad_accum", "backend",
                 "precision", "checkpoint_activations", "pack"):
        assert RunConfig.default(name) == getattr(r, name), name
    for name in ("targets", "rank", "alpha"):
        assert RunConfig.default(name) == getattr(lora, name), name
    assert (r.seed, r.init_scale) == (lora.seed, lora.init_scale)
    recipe = LoRA()
    assert (recipe.targets, recipe.rank, recipe.alpha) == (lora.targets, lora.rank, lora.alpha)


def test_model_commands_default_to_the_recipe_backend_and_precision(required):
    parser = build_parser()
    for argv in (["eval", "--model", "m", "--text", "x"],
                 ["generate", "--model", "m", "--prompt", "x"],
                 ["chat", "--model", "m"], ["demo"]):
        args = parser.parse_args(argv)
        assert (args.backend, args.precision) == (RecipeOptions.backend, RecipeOptions.precision)
    cfg = run_config_from_args(_parsed(*required))
    assert (cfg.backend, cfg.precision) == (RecipeOptions.backend, RecipeOptions.precision)


def test_precision_reaches_the_session_and_is_refused_on_the_cpu(required):
    """--precision becomes RunConfig.precision, RecipeOptions.precision and
    Session(precision=); the numpy backend computes f32 matmuls only."""
    cfg = run_config_from_args(_parsed(*required, "--precision", "bf16", "--backend", "cuda"))
    assert cfg.precision == "bf16"
    assert RecipeOptions(precision="tf32", backend="cuda").precision == "tf32"
    assert Session(Graph(), backend="cpu", precision="f32").backend.name == "cpu"
    for p in PRECISIONS[1:]:
        with pytest.raises(GraphError, match=f"precision '{p}'.*needs the cuda backend"):
            Session(Graph(), backend="cpu", precision=p)
        with pytest.raises(GraphError, match="RecipeOptions.precision"):
            RecipeOptions(precision=p)
    with pytest.raises(SystemExit):   # argparse names the choices
        _parsed(*required, "--precision", "f16")


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
    s = Session(Graph(), backend="cpu", dtype="f64")
    assert s.backend.dtype == np.float64
    with pytest.raises(GraphError, match="dtype must be f32 or f64"):
        Session(Graph(), backend="cpu", dtype="bf16")


def test_base_memory_reaches_the_session_and_run_start(tiny_llama, tmp_path):
    """--base-memory quantized keeps the block-format base as block bytes (core/frozen_base.py),
    and run_start says what the plan holds."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"word {i} " * 8}) + "\n" for i in range(4)))
    out = tmp_path / "r"
    assert main(["finetune", "--model", str(tiny_llama), "--data", str(data), "--out", str(out),
                 "--steps", "1", "--batch", "2", "--seq-len", "16", "--val-split", "0",
                 "--base-memory", "quantized", "--quiet"]) == 0
    start = json.loads((out / "events.jsonl").read_text().splitlines()[0])
    assert start["config"]["base_memory"] == "quantized"
    assert start["plan"]["base_memory"] == "quantized" and start["plan"]["base_bytes"] > 0
