"""Golden-loss regression: every CPU golden file is reproduced, runs are bit-identical,
losses fall, and a saved adapter reloads to the same loss."""
import json

import numpy as np
import pytest

from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
from toygraph.fixtures.golden import GOLDEN_DIR, compare

CPU_GOLDENS = sorted(p.name.split(".")[0] for p in GOLDEN_DIR.glob("*.cpu.json"))


def test_every_experiment_has_a_cpu_golden():
    assert set(CPU_GOLDENS) == set(EXPERIMENTS)


@pytest.mark.parametrize("replay", ["engine", "numpy"])
@pytest.mark.parametrize("name", CPU_GOLDENS)
def test_cpu_golden(name, replay, request, monkeypatch):
    """Both of the CPU backend's replays: its numpy kernels (the goldens' own) and the
    engine's (the default)."""
    if EXPERIMENTS[name].model == "smollm2":
        request.getfixturevalue("smollm2")  # skips when the model cannot be had
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", replay)
    ok, detail, losses = compare(name, "cpu")
    assert ok, detail
    # The loss falls: the last two steps average below the first two.
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses
    doc = json.loads((GOLDEN_DIR / f"{name}.cpu.json").read_text())
    assert {"experiment", "backend", "environment", "losses", "tolerance"} <= set(doc)


def test_runs_are_bit_identical():
    exp = EXPERIMENTS["lora_all_tiny_qwen2"]
    assert run_experiment(exp) == run_experiment(exp)


@pytest.mark.parametrize("name", ["lora_qv_tiny_llama", "lora_all_tiny_qwen2", "dpo_qv_tiny_llama",
                                  "orpo_qv_tiny_llama"])
def test_saved_adapter_reloads_and_reproduces_the_last_loss(name, tmp_path):
    from toygraph.adapters.files import load_peft, save_peft
    from toygraph.fixtures.experiments import make_recipe, model_path, reference_base_memory
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import RecipeOptions
    exp = EXPERIMENTS[name]
    losses, recipe, data = run_experiment(exp, return_recipe=True)
    toks, labels = data[-1]
    pos = np.tile(np.arange(toks.shape[-1], dtype=np.int32), (toks.shape[0], 1))
    want = recipe.evaluate(toks, pos, labels)
    lora = {k: (recipe.sess.download(a), recipe.sess.download(b)) for k, (a, b) in recipe.net.lora.items()}
    r = exp.recipe_args
    save_peft(tmp_path, lora, recipe.model_cfg, rank=r["rank"], alpha=r["alpha"],
              targets=list(r["targets"]), base_model_name=name)
    model = GGUFModel(model_path(exp.model))
    fresh = make_recipe(exp)
    # Held as the trained run held it: the engine's products on the blocks agree with the
    # decoded base's BLAS products to f32 rounding, not bit for bit (core/frozen_base.py).
    base = reference_base_memory(exp)
    fresh.realize(model, model.config, RecipeOptions(**{**exp.options, "base_memory": base}))
    loaded, *_ = load_peft(tmp_path, model.config)
    fresh.load_trainable({f"{k}.lora_{s}": v for k, (a, b) in loaded.items()
                          for s, v in (("a", a), ("b", b))})
    assert fresh.evaluate(toks, pos, labels) == want
