"""Adapter files that must not load: another architecture's adapter, integer tensors, a
config whose numbers or settings we cannot honour."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from toygraph.adapters.files import (WEIGHTS_FILE, load_gguf_adapter, load_peft, read_peft,
                                     save_gguf_adapter, save_peft)
from toygraph.cli import main
from toygraph.demo.capitals import data_path as capitals_data
from toygraph.errors import DataError
from toygraph.models.model import GGUFModel
from toygraph.models.decoder import weight_shape

from support.random_adapters import random_lora

NAME = "blk.0.attn_q.weight"
PREFERENCES = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "preferences.jsonl"
CAPITALS = capitals_data()


def _adapter(cfg, tmp_path):
    out_dim, in_dim = weight_shape(cfg, NAME)
    rng = np.random.default_rng(0)
    lora = {NAME: (rng.normal(size=(2, in_dim)).astype(np.float32),
                   rng.normal(size=(out_dim, 2)).astype(np.float32))}
    return save_peft(tmp_path, lora, cfg, rank=2, alpha=4.0, targets=["q"])


def test_a_qwen2_adapter_is_refused_on_a_llama_model_of_the_same_shape(tiny_llama, tiny_qwen2, tmp_path):
    qwen, llama = GGUFModel(tiny_qwen2).config, GGUFModel(tiny_llama).config
    assert weight_shape(qwen, NAME) == weight_shape(llama, NAME)
    folder = _adapter(qwen, tmp_path)
    assert load_peft(folder, qwen)[1] == 2
    with pytest.raises(DataError, match="trained on a qwen2 model; the base model is llama"):
        load_peft(folder, llama)


def test_integer_adapter_tensors_are_refused(tiny_llama, tmp_path):
    from safetensors.numpy import load_file, save_file
    cfg = GGUFModel(tiny_llama).config
    folder = _adapter(cfg, tmp_path)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = np.round(tensors[key] * 10).astype(np.int32)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    with pytest.raises(DataError, match=rf"tensor '{key}' is int32; adapter tensors must be floating"):
        load_peft(folder, cfg)


# --- what adapter_config.json says is honoured or refused, never ignored (issue 39) ------------
def _full_adapter(cfg, folder, alpha=8.0, rank=2, targets=("q", "v"), scale=0.05, seed=0, **config):
    """A PEFT adapter of every layer's ``targets``; ``config`` entries are written into its
    adapter_config.json afterwards (as another tool would have)."""
    lora = random_lora(cfg, targets, rank, seed, scale)
    save_peft(folder, lora, cfg, rank=rank, alpha=alpha, targets=list(targets))
    if config:
        path = folder / "adapter_config.json"
        doc = json.loads(path.read_text())
        doc.update(config)
        path.write_text(json.dumps(doc))
    return folder


@pytest.mark.parametrize("alpha, needle", [
    (float("nan"), "lora_alpha must be a finite number > 0, found nan"),
    (float("inf"), "lora_alpha must be a finite number > 0, found inf"),
    (1e308, "scales the update by 5e+307, above 1024"),
    (-4, "lora_alpha must be a finite number > 0, found -4"),
    ("16", "lora_alpha must be a finite number > 0, found '16'"),
])
def test_lora_alpha_is_finite_and_in_range(tiny_llama, tmp_path, alpha, needle):
    cfg = GGUFModel(tiny_llama).config
    folder = _full_adapter(cfg, tmp_path / "a", lora_alpha=alpha)
    with pytest.raises(DataError, match=re.escape(needle)):
        read_peft(folder, cfg)


def test_export_and_eval_refuse_a_nan_alpha_in_one_line(tiny_llama, tmp_path, capsys):
    """NaN alpha: export wrote an all-NaN merged GGUF with exit 0, eval printed loss nan."""
    folder = _full_adapter(GGUFModel(tiny_llama).config, tmp_path / "a", lora_alpha=float("nan"))
    out = tmp_path / "merged.gguf"
    assert main(["export", "--model", str(tiny_llama), "--adapter", str(folder), "--out", str(out),
                 "--type", "f32"]) == 2
    assert main(["eval", "--model", str(tiny_llama), "--adapter", str(folder), "--tokens", "3,4,5",
                 "--json"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("lora_alpha must be a finite number > 0, found nan" in e for e in err)
    assert not out.exists()


def test_huge_finite_adapter_values_are_refused_where_they_overflow(tiny_llama, tmp_path, capsys):
    """Finite tensors whose product overflows f32: eval's loss is not a number and the
    merge's weight not finite; both said in one line, no NaN JSON, no NaN GGUF."""
    folder = _full_adapter(GGUFModel(tiny_llama).config, tmp_path / "a", scale=1e30)
    out = tmp_path / "merged.gguf"
    assert main(["eval", "--model", str(tiny_llama), "--adapter", str(folder), "--tokens", "3,4,5",
                 "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "computes values that are not finite" in captured.err
    assert main(["export", "--model", str(tiny_llama), "--adapter", str(folder), "--out", str(out),
                 "--type", "f32"]) == 2
    assert "the merged weight (base + 4 B A) is not finite" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("key, value", [
    ("lora_bias", True), ("use_qalora", True), ("trainable_token_indices", [3, 4]),
    ("layer_replication", [[0, 1]]), ("modules_to_save", ["lm_head"]),
    ("alora_invocation_tokens", [5]), ("init_lora_weights", "pissa"),
    ("a_future_peft_key", {"on": 1}), ("rank_pattern", {"q_proj": 4}),
])
def test_a_setting_that_changes_the_math_is_refused_by_name(tiny_llama, tmp_path, key, value):
    cfg = GGUFModel(tiny_llama).config
    folder = _full_adapter(cfg, tmp_path / "a", **{key: value})
    with pytest.raises(DataError, match=key) as e:
        read_peft(folder, cfg)
    assert "\n" not in str(e.value)


def test_settings_that_leave_the_math_alone_load(tiny_llama, tmp_path):
    cfg = GGUFModel(tiny_llama).config
    plain = read_peft(_full_adapter(cfg, tmp_path / "p"), cfg)
    same = read_peft(_full_adapter(cfg, tmp_path / "s", init_lora_weights="gaussian",
                                   lora_bias=False, trainable_token_indices=None,
                                   a_future_peft_key=None, exclude_modules=["o_proj"],
                                   layers_pattern="layers"), cfg)
    assert same.alpha == plain.alpha and all(
        np.array_equal(x, y) for n in plain.lora for x, y in zip(plain.lora[n], same.lora[n]))


def test_layers_to_transform_is_honoured(tiny_llama, tmp_path):
    """An adapter of layer 0 only loads as that (the others keep B = 0, PEFT's model);
    tensors of a layer the config leaves out, which PEFT would not load, are refused."""
    cfg = GGUFModel(tiny_llama).config
    assert cfg.n_layer >= 2
    folder = _full_adapter(cfg, tmp_path / "a", layers_to_transform=[0])
    with pytest.raises(DataError, match=r"is in layer 1, which layers_to_transform \[0\]"):
        read_peft(folder, cfg)
    from safetensors.numpy import load_file, save_file
    tensors = {k: v for k, v in load_file(str(folder / WEIGHTS_FILE)).items() if ".layers.0." in k}
    save_file(tensors, str(folder / WEIGHTS_FILE))
    assert {n.split(".")[1] for n in read_peft(folder, cfg).lora} == {"0"}
    for bad in ([-1], "0", [True], []):
        _full_adapter(cfg, tmp_path / "b", layers_to_transform=bad)
        with pytest.raises(DataError, match="layers_to_transform must be"):
            read_peft(tmp_path / "b", cfg)


def test_a_deeply_nested_adapter_config_is_one_line(tiny_llama, tmp_path, capsys):
    folder = _full_adapter(GGUFModel(tiny_llama).config, tmp_path / "a")
    (folder / "adapter_config.json").write_text('{"r": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert main(["eval", "--model", str(tiny_llama), "--adapter", str(folder), "--tokens", "3,4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "JSON nested 100001 levels deep" in err, err


def test_a_gguf_adapter_alpha_of_zero_means_none_as_in_llama_cpp(tiny_llama, tmp_path):
    """llama.cpp: adapter.lora.alpha 0 is a scale of 1; it was a scale of 0 (no update)."""
    cfg = GGUFModel(tiny_llama).config
    lora = read_peft(_full_adapter(cfg, tmp_path / "a", rank=2), cfg).lora
    path = save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=0.0, base_arch=cfg.arch)
    assert load_gguf_adapter(path, cfg)[1:3] == (2, 2.0)
    path = save_gguf_adapter(tmp_path / "n.gguf", lora, cfg, alpha=float("nan"), base_arch=cfg.arch)
    with pytest.raises(DataError, match="adapter.lora.alpha nan"):
        load_gguf_adapter(path, cfg)


@pytest.mark.parametrize("recipe", ["lora", "dpo"])
def test_adapter_init_takes_the_adapters_alpha_or_says_so(tiny_llama, tmp_path, recipe):
    """--adapter-init checked rank, targets and variants but not lora_alpha: an adapter of
    alpha 64 went on at the run's 16 (also as DPO's frozen reference). A mismatch is
    refused, as a rank mismatch is; --alpha equal to the adapter's runs."""
    from toygraph.training import RunConfig, run_training
    cfg = GGUFModel(tiny_llama).config
    init = _full_adapter(cfg, tmp_path / "init", alpha=64.0, rank=2)
    data = (PREFERENCES if recipe == "dpo" else CAPITALS)
    kw = dict(model=str(tiny_llama), data=str(data), recipe=recipe, targets=("q", "v"), rank=2,
              steps=1, batch=2, seq_len=96, val_split=0.0, quiet=True, max_examples=8,
              adapter_init=str(init))
    with pytest.raises(DataError, match="adapter has lora_alpha 64; the run asks for --alpha 16 "
                                        r".*give --alpha 64"):
        run_training(RunConfig(out=str(tmp_path / "r16"), **kw))
    assert run_training(RunConfig(out=str(tmp_path / "r64"), alpha=64, **kw))["steps"] == 1


def test_adapter_init_of_another_shape_names_the_flags_that_continue_it(tiny_llama, tmp_path):
    """docs/usage.md's DPO example once passed --targets q,k,v,o to continue an SFT adapter
    trained on the defaults (q, v): the refusal names the flags that match the adapter."""
    from toygraph.training import RunConfig, run_training
    cfg = GGUFModel(tiny_llama).config
    init = _full_adapter(cfg, tmp_path / "init", alpha=4.0, rank=2)
    kw = dict(model=str(tiny_llama), data=str(PREFERENCES), recipe="dpo", steps=1, batch=2,
              seq_len=96, val_split=0.0, quiet=True, max_examples=8, adapter_init=str(init))
    with pytest.raises(DataError, match="adapter has rank 2 and targets q,v; the run asks for "
                                        "rank 8 and targets q,k,v,o: give --targets q,v --rank 2 "
                                        "--alpha 4 to continue"):
        run_training(RunConfig(out=str(tmp_path / "bad"), targets=("q", "k", "v", "o"), **kw))
    ok = RunConfig(out=str(tmp_path / "ok"), targets=("q", "v"), rank=2, alpha=4, **kw)
    assert run_training(ok)["steps"] == 1
