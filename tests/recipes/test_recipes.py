"""Recipes own their step (recipes/): the registry, the loss hook of the one realize, and a
new recipe plugging into runs without the training loop or the CLI knowing its name."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from toygraph import ops
from toygraph.errors import ToygraphError
from toygraph.recipes import RECIPES, LoRA, RecipeOptions, recipe_class
from toygraph.recipes.registry import register
from toygraph.training import RunConfig, run_training

ROOT = Path(__file__).resolve().parents[2]


def test_every_recipe_is_registered_under_its_name():
    assert list(RECIPES) == ["lora", "full", "scratch", "dpo", "orpo", "grpo"]
    for name, cls in RECIPES.items():
        assert cls.name == name and recipe_class(name) is cls
    with pytest.raises(ToygraphError, match="--recipe must be one of lora, full, scratch, dpo, "
                                            "orpo, grpo, got 'ppo'"):
        recipe_class("ppo")
    with pytest.raises(ToygraphError, match="two recipes are named 'lora'"):
        register("lora")(type("Again", (LoRA,), {}))


def test_the_loop_and_the_cli_name_no_recipe():
    """No string literal in training/ or cli/ is a recipe's name (they go through the
    registry and the recipe's hooks), but for the default of --recipe."""
    names, found = set(RECIPES), []
    for folder in ("toygraph/training", "toygraph/cli"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append((path.name, node.value))
    assert found == [("run_config.py", RunConfig.default("recipe"))], found


class HalfLoss(LoRA):
    """A recipe the package does not have: LoRA whose loss is half the cross-entropy, with
    a metric of its own. Only its module (this class) knows it."""

    def build_loss(self, g, opts):
        loss_sum, count = super().build_loss(g, opts)
        self.loss_sum = g.output(ops.scale(loss_sum, 0.5))
        return self.loss_sum, count

    def finish_step(self, sums):
        loss = super().finish_step(sums)
        self.last_metrics = {"halved": 1.0}
        return loss


@pytest.fixture
def half_loss():
    register("half_loss")(HalfLoss)
    yield HalfLoss
    del RECIPES["half_loss"]


def _data(tmp_path) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Colour {i}?", "response": c}) + "\n"
                            for i, c in enumerate(["red", "green", "blue", "teal"] * 2)))
    return data


def test_a_new_recipe_trains_through_the_unchanged_loop(half_loss, tiny_llama, tmp_path):
    data = _data(tmp_path)
    common = dict(model=str(tiny_llama), data=str(data), steps=2, batch=2, seq_len=32,
                  val_split=0, rank=2, quiet=True, seed=1)
    run_training(RunConfig(out=str(tmp_path / "lora"), **common))
    run_training(RunConfig(out=str(tmp_path / "half"), recipe="half_loss", **common))
    steps = {k: [json.loads(l) for l in (tmp_path / k / "events.jsonl").read_text().splitlines()
                 if json.loads(l)["event"] == "step"] for k in ("lora", "half")}
    # the first step's loss is computed before any update: exactly half (x0.5 is exact in f32)
    assert steps["half"][0]["loss"] == 0.5 * steps["lora"][0]["loss"]
    assert steps["half"][0]["halved"] == 1.0
    assert (tmp_path / "half" / "adapter_model.safetensors").is_file()   # an adapter recipe


def test_the_run_options_follow_what_a_new_recipe_is(half_loss):
    """An adapter recipe gets the adapter options without being listed anywhere."""
    assert "half_loss" in RunConfig.recipes_using("rank")
    assert "half_loss" not in RunConfig.recipes_using("beta")
    RunConfig(model="m", data="d", out="o", recipe="half_loss", rank=4).validate()


def test_dpo_with_activation_checkpointing_gives_the_same_losses(tiny_llama):
    """The preference recipes realize through the same hook, so --checkpoint-activations
    (recomputing each policy block in the backward) applies to them and changes nothing."""
    from test_dpo import _realize, _two_steps
    from toygraph.recipes import DPO
    results = []
    for ckpt in (False, True):
        recipe = _realize(DPO(("q", "v"), beta=0.5, label_smoothing=0.1), tiny_llama,
                          init_scale=0.3, checkpoint_activations=ckpt)
        assert recipe.train.checkpoint is not None if ckpt else recipe.train.checkpoint is None
        results.append(_two_steps(recipe, tiny_llama))
    assert [{k: float(v).hex() for k, v in r.items()} for r in results[0]] == \
        [{k: float(v).hex() for k, v in r.items()} for r in results[1]]


def test_recipe_options_come_from_the_run_config():
    from toygraph.training.run_config import recipe_options
    cfg = RunConfig(model="m", data="d", out="o", batch=8, seq_len=64, pack=True, clip=0.5)
    opts = recipe_options(cfg, ranks=2)
    assert (opts.batch, opts.seq_len, opts.pack, opts.clip, opts.data_parallel) == \
        (4, 64, True, 0.5, True)
    assert recipe_class("dpo").from_options(RunConfig(model="m", data="d", out="o",
                                                      recipe="dpo", beta=0.3)).beta == 0.3
    assert isinstance(recipe_options(cfg), RecipeOptions) and np.isfinite(opts.init_scale)
