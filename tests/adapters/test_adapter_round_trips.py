"""Adapter files (toygraph/adapters/files.py): PEFT directories and llama.cpp GGUF adapters,
round trips and errors. (Adapters that must not load: test_adapter_files.py.)"""
import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from toygraph.adapters.files import (CONFIG_FILE, WEIGHTS_FILE, check_gguf_adapter, hf_row_order,
                               load_gguf_adapter, load_peft, save_gguf_adapter, save_peft)
from toygraph.errors import DataError
from toygraph.models.model import GGUFModel
from toygraph.models.decoder import TARGETS

from support.random_adapters import random_lora

ALL = tuple(TARGETS)



@pytest.fixture(scope="module")
def cfg(tiny_llama):
    return GGUFModel(tiny_llama).config


# --- the q/k row conversion ----------------------------------------------------------------
def test_hf_row_order_is_transformers_unpermute_and_its_inverse(cfg, tiny_qwen2):
    rng = np.random.default_rng(1)
    for proj, n_head in (("attn_q", cfg.n_head), ("attn_k", cfg.n_head_kv)):
        name = f"blk.0.{proj}.weight"
        b = rng.normal(size=(n_head * cfg.head_dim, 3)).astype(np.float32)
        hf = hf_row_order(b, cfg, name, to_hf=True)
        # transformers' LlamaTensorProcessor._reverse_permute_weights, written out.
        want = b.reshape(n_head, cfg.head_dim // 2, 2, 3).swapaxes(1, 2).reshape(b.shape)
        np.testing.assert_array_equal(hf, want)
        assert not np.array_equal(hf, b)
        np.testing.assert_array_equal(hf_row_order(hf, cfg, name, to_hf=False), b)
    v = rng.normal(size=(cfg.n_head_kv * cfg.head_dim, 3))
    assert hf_row_order(v, cfg, "blk.0.attn_v.weight", to_hf=True) is v
    qcfg = GGUFModel(tiny_qwen2).config  # neox layout: stored unpermuted
    q = rng.normal(size=(qcfg.n_head * qcfg.head_dim, 3))
    assert hf_row_order(q, qcfg, "blk.0.attn_q.weight", to_hf=True) is q


# --- PEFT ----------------------------------------------------------------------------------
def test_peft_round_trip(cfg, tmp_path):
    lora = random_lora(cfg)
    save_peft(tmp_path / "a", lora, cfg, rank=4, alpha=8, targets=ALL, base_model_name="tiny")
    config = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (4, 8.0, "none")
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"}
    tensors = load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_"
    assert tensors[key + "A.weight"].shape == (4, cfg.n_embd)
    np.testing.assert_array_equal(tensors[key + "A.weight"], lora["blk.1.attn_q.weight"][0])
    np.testing.assert_array_equal(tensors[key + "B.weight"],
                                  hf_row_order(lora["blk.1.attn_q.weight"][1], cfg,
                                               "blk.1.attn_q.weight", to_hf=True))
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in tensors
    back, rank, alpha, targets = load_peft(tmp_path / "a", cfg)
    assert (rank, alpha, targets) == (4, 8.0, ALL)
    assert set(back) == set(lora)
    for name, (a, b) in lora.items():
        np.testing.assert_array_equal(back[name][0], a)
        np.testing.assert_array_equal(back[name][1], b)
    assert not list((tmp_path / "a").glob("*.partial"))


def test_save_peft_rejects_bad_adapters(cfg, tmp_path):
    lora = random_lora(cfg, ("q",))
    with pytest.raises(DataError, match="rank 4, but rank=8"):
        save_peft(tmp_path, lora, cfg, rank=8, alpha=8, targets=("q",))
    with pytest.raises(DataError, match="uncovered"):
        save_peft(tmp_path, lora, cfg, rank=4, alpha=8, targets=("v",))
    a, b = lora["blk.0.attn_q.weight"]
    with pytest.raises(DataError, match="do not fit"):
        save_peft(tmp_path, {"blk.0.attn_q.weight": (a, b[:-1])}, cfg, 4, 8, ("q",))


def _peft_dir(cfg, tmp_path, config_edit=None, tensor_edit=None):
    d = tmp_path / "bad"
    save_peft(d, random_lora(cfg, ("q", "v")), cfg, rank=4, alpha=8, targets=("q", "v"))
    if config_edit:
        config = json.loads((d / CONFIG_FILE).read_text())
        config_edit(config)
        (d / CONFIG_FILE).write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(str(d / WEIGHTS_FILE))
        tensor_edit(tensors)
        save_file(tensors, str(d / WEIGHTS_FILE))
    return d


Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_"


@pytest.mark.parametrize("case, match", [
    ("no_config", "adapter_config.json: missing"),
    ("no_weights", "adapter_model.safetensors: missing"),
    ("bad_json", "adapter_config.json: not valid JSON"),
    ("not_lora", "peft_type is 'IA3'"),
    ("dora", r"has \['A', 'B'\] of \['A', 'B', 'm'\] \(use_dora=true"),   # no magnitudes
    ("rslora", "an rsLoRA adapter; this use takes plain LoRA adapters only"),
    ("fan_in_fan_out", "fan_in_fan_out=true is not supported"),
    ("bad_key", "'base_model.model.model.layers.0.self_attn.qkv.lora_A.weight' does not map"),
    ("bad_layer", "layers.7.self_attn.q_proj.lora_A.weight' does not map"),
    ("bad_shape", "do not fit the weight"),
    ("rank_ab", "rank mismatch: A has 4 rows, B has 3 columns"),
    ("rank_config", "rank 4 but adapter_config.json says r=8"),
    ("half_pair", r"has \['A'\] of \['A', 'B'\]"),
    ("corrupt", "cannot read safetensors"),
])
def test_load_peft_errors(cfg, tmp_path, case, match):
    edits = {
        "not_lora": dict(config_edit=lambda c: c.update(peft_type="IA3")),
        "dora": dict(config_edit=lambda c: c.update(use_dora=True)),
        "rslora": dict(config_edit=lambda c: c.update(use_rslora=True)),
        "fan_in_fan_out": dict(config_edit=lambda c: c.update(fan_in_fan_out=True)),
        "rank_config": dict(config_edit=lambda c: c.update(r=8)),
        "bad_key": dict(tensor_edit=lambda t: t.update(
            {Q0.replace("q_proj", "qkv") + "A.weight": t[Q0 + "A.weight"]})),
        "bad_layer": dict(tensor_edit=lambda t: t.update(
            {Q0.replace("layers.0", "layers.7") + "A.weight": t[Q0 + "A.weight"]})),
        "bad_shape": dict(tensor_edit=lambda t: t.update(
            {Q0 + "A.weight": t[Q0 + "A.weight"][:, :-2].copy()})),
        "rank_ab": dict(tensor_edit=lambda t: t.update(
            {Q0 + "B.weight": t[Q0 + "B.weight"][:, :3].copy()})),
        "half_pair": dict(tensor_edit=lambda t: t.pop(Q0 + "B.weight")),
    }
    d = _peft_dir(cfg, tmp_path, **edits.get(case, {}))
    if case == "no_config":
        (d / CONFIG_FILE).unlink()
    elif case == "no_weights":
        (d / WEIGHTS_FILE).unlink()
    elif case == "bad_json":
        (d / CONFIG_FILE).write_text('{"peft_type": "LORA", ')
    elif case == "corrupt":
        (d / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DataError, match=match) as e:
        load_peft(d, cfg)
    assert str(d) in str(e.value)  # every message names the file


# --- llama.cpp GGUF adapters ---------------------------------------------------------------
def test_gguf_adapter_round_trip_and_llama_cpp_rules(cfg, tiny_llama, tmp_path):
    lora = random_lora(cfg, ("q", "k", "down"), rank=3)
    path = save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=6, base_arch="llama")
    info = check_gguf_adapter(path, tiny_llama)
    assert (info["rank"], info["alpha"], len(info["tensors"])) == (3, 6.0, len(lora))
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight.lora_a")
    assert tuple(t.shape) == (cfg.n_ff, 3)  # ggml ne: [n_in, r]
    back, rank, alpha, targets = load_gguf_adapter(path, cfg)
    assert (rank, alpha, targets) == (3, 6.0, ("q", "k", "down"))
    for name, (a, b) in lora.items():  # GGUF order on both sides: no permutation
        np.testing.assert_array_equal(back[name][0], a)
        np.testing.assert_array_equal(back[name][1], b)


def _write_adapter(path, arch="llama", kv=None, tensors=()):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv if kv is not None else
                       {"general.type": "adapter", "adapter.type": "lora",
                        "adapter.lora.alpha": 8.0}).items():
        (w.add_float32 if isinstance(value, float) else w.add_string)(key, value)
    for name, array in tensors:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _pairs(cfg, rank=2):
    a = np.zeros((rank, cfg.n_embd), np.float32)
    b = np.zeros((cfg.n_head * cfg.head_dim, rank), np.float32)
    return [("blk.0.attn_q.weight.lora_a", a), ("blk.0.attn_q.weight.lora_b", b)]


@pytest.mark.parametrize("case, match", [
    ("wrong_arch", "architecture 'qwen2' does not match the base model's 'llama'"),
    ("not_adapter", "general.type is 'model', expected 'adapter'"),
    ("not_lora", "adapter.type is 'ia3', expected 'lora'"),
    ("no_alpha", "adapter.lora.alpha is missing"),
    ("swapped", "a/b transposed"),
    ("missing_pair", "pair for 'blk.0.attn_q.weight' is missing one component"),
    ("unknown_tensor", "'blk.9.attn_q.weight' does not exist in the base model"),
    ("rank", "rank mismatch"),
])
def test_broken_gguf_adapters_fail_like_llama_cpp(cfg, tiny_llama, tmp_path, case, match):
    good = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0}
    pairs = _pairs(cfg)
    kw = {
        "wrong_arch": dict(arch="qwen2"),
        "not_adapter": dict(kv={**good, "general.type": "model"}),
        "not_lora": dict(kv={**good, "adapter.type": "ia3"}),
        "no_alpha": dict(kv={k: v for k, v in good.items() if k != "adapter.lora.alpha"}),
        "swapped": dict(tensors=[(n, np.ascontiguousarray(x.T)) for n, x in pairs]),
        "missing_pair": dict(tensors=pairs[:1]),
        "unknown_tensor": dict(tensors=[(n.replace("blk.0", "blk.9"), x) for n, x in pairs]),
        "rank": dict(tensors=[pairs[0], (pairs[1][0], np.zeros((pairs[1][1].shape[0], 3), np.float32))]),
    }[case]
    kw.setdefault("tensors", pairs)
    path = _write_adapter(tmp_path / f"{case}.gguf", **kw)
    with pytest.raises(DataError, match=match) as e:
        check_gguf_adapter(path, tiny_llama)
    assert str(path) in str(e.value)
    with pytest.raises(DataError, match=match):  # the loader applies the same rules to cfg
        load_gguf_adapter(path, cfg)


def test_gguf_adapter_file_errors(cfg, tiny_llama, tmp_path):
    with pytest.raises(DataError, match="no such GGUF adapter file"):
        check_gguf_adapter(tmp_path / "none.gguf", tiny_llama)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF junk")
    with pytest.raises(DataError, match="not a valid GGUF file"):
        load_gguf_adapter(tmp_path / "junk.gguf", cfg)
