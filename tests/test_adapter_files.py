"""Adapter files that must not load: another architecture's adapter, integer tensors."""
import numpy as np
import pytest

from toygraph.adapters.files import WEIGHTS_FILE, load_peft, save_peft
from toygraph.errors import DataError
from toygraph.models.model import GGUFModel
from toygraph.models.decoder import weight_shape

NAME = "blk.0.attn_q.weight"


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
