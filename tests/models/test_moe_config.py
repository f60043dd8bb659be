"""Every mixture-of-experts key of a GGUF is implemented or refused in one line
(models/readers.py's experts), on the metadata of the committed llama.cpp conversion."""
import os

import numpy as np
import pytest

from support.moe_references import gguf_path
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from toygraph.errors import GGUFError
from toygraph.gguf.file import GGUFFile
from toygraph.models.config import check_tensors, layer_shapes, read_config
from toygraph.models.decoder import WeightSource, build_decoder


def config_with(changes: dict, name="qwen3moe"):
    """read_config of the file's metadata with ``changes`` ("<arch>." keys; None removes)."""
    f = GGUFFile(gguf_path(name))
    arch = f.metadata("general.architecture")
    meta = {k: f.metadata(k) for k in f.reader.fields}
    for key, value in changes.items():
        meta.pop(f"{arch}.{key}", None)
        if value is not None:
            meta[f"{arch}.{key}"] = value
    return read_config(meta.get, list(meta), f._shapes, "m.gguf"), f._shapes


def test_the_file_reads_as_a_mixture():
    cfg, shapes = config_with({})
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (6, 2, 32)
    assert cfg.experts.norm_weights and cfg.experts.weights_scale == 1.0
    assert all(layer.ffn == cfg.experts for layer in cfg.layers)   # no leading dense layer
    check_tensors(cfg, shapes, "m.gguf")   # every tensor consumed, none missing


@pytest.mark.parametrize("changes, message", [
    ({"expert_shared_count": 1}, "shared experts are not implemented"),
    ({"expert_shared_feed_forward_length": 64}, "shared experts are not implemented"),
    ({"expert_gating_func": 2}, r"expert_gating_func = 2 is not supported \(only 1, softmax\)"),
    ({"expert_used_count": 7}, "expert_used_count = 7 exceeds qwen3moe.expert_count = 6"),
    ({"expert_count": None}, "missing metadata key 'qwen3moe.expert_count'"),
    ({"expert_feed_forward_length": None}, "missing metadata key 'qwen3moe.expert_feed_forward"),
    ({"expert_weights_norm": 1}, "must be a bool"),
    ({"leading_dense_block_count": 2}, r"must be in \[0, block_count = 2\)"),
    ({"expert_group_count": 2}, "'qwen3moe.expert_group_count' is not understood"),
])
def test_keys_that_would_change_the_math_are_refused_in_one_line(changes, message):
    with pytest.raises(GGUFError, match=message) as e:
        config_with(changes)
    assert "\n" not in str(e.value)


def test_a_shared_expert_is_read_where_the_family_has_one():
    """Qwen2-MoE's shared expert: its width from expert_shared_feed_forward_length, its
    tensors required; more than one shared expert is refused in one line."""
    cfg, shapes = config_with({}, "qwen2moe")
    assert cfg.experts.shared.width == 48
    assert layer_shapes(cfg, 0)["blk.0.ffn_gate_inp_shexp.weight"] == (1, cfg.n_embd)
    check_tensors(cfg, shapes, "m.gguf")
    with pytest.raises(GGUFError, match=r"expert_shared_count must be 1") as e:
        config_with({"expert_shared_count": 2}, "qwen2moe")
    assert "\n" not in str(e.value)
    with pytest.raises(GGUFError, match="missing metadata key 'qwen2moe.expert_shared_feed"):
        config_with({"expert_shared_feed_forward_length": None}, "qwen2moe")


def test_weights_norm_and_scale_are_read():
    cfg, _ = config_with({"expert_weights_norm": False, "expert_weights_scale": 2.5})
    assert not cfg.experts.norm_weights and cfg.experts.weights_scale == 2.5


def test_leading_dense_layers_have_a_plain_ffn():
    cfg, shapes = config_with({"leading_dense_block_count": 1})
    assert "blk.0.ffn_gate.weight" in layer_shapes(cfg, 0)
    assert "blk.1.ffn_gate_exps.weight" in layer_shapes(cfg, 1)
    with pytest.raises(GGUFError, match="missing required tensor 'blk.0.ffn_gate.weight'"):
        check_tensors(cfg, shapes, "m.gguf")
    # The builder follows the config: a dense layer 0, an expert layer 1, finite loss.
    g = Graph()
    net = build_decoder(g, cfg, WeightSource(mode="scratch"), batch=1, seq_len=5)
    labels = g.input("labels", (5,), "i32")
    loss = g.output(ops.cross_entropy(net.logits, labels))
    assert "ffn_gate_exps" not in " ".join(n for n in net.weights if n.startswith("blk.0."))
    s = Session(g)
    s.realize()
    s.upload(net.tokens, np.arange(5, dtype=np.int32)[None])
    s.upload(net.positions, np.arange(5, dtype=np.int32)[None])
    s.upload(labels, np.arange(1, 6, dtype=np.int32))
    s.run("forward")
    assert np.isfinite(s.download(loss))


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_expert_tensors_are_advised_random_only_by_the_piecewise_reader():
    """Loading a model leaves every mapping with the default read-ahead (a whole-tensor
    decode or a device upload wants it); the quantized expert kernel advises its stacked
    experts MADV_RANDOM ("rr") through BlockTensor.read_sparsely, so a fault there reads
    its page, not the read-ahead window of unused experts around it."""
    from toygraph.cpu.block_tensor import BlockTensor
    from toygraph.models.model import GGUFModel
    model = GGUFModel(gguf_path("qwen3moe"))
    base = model.reader.mmap.ctypes.data
    tensors = {t.name: t for t in model.reader.tensors}
    exps = [n for n in tensors if n.endswith("_exps.weight")]
    assert len(exps) == 3 * model.config.n_layer
    assert not any("rr" in _vma_flags(base + tensors[n].data_offset) for n in exps)
    t = model.tensor(exps[0])
    BlockTensor(t.raw, t.qtype, t.shape).read_sparsely()
    assert "rr" in _vma_flags(base + tensors[exps[0]].data_offset)
    assert "rr" not in _vma_flags(base + tensors["token_embd.weight"].data_offset)
