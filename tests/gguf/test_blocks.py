"""Our numpy dequantizers against gguf-py's reference, bit for bit."""
import numpy as np
import pytest
import gguf
import gguf.quants as gq

from toygraph.gguf import block_encode, blocks
from toygraph.errors import GGUFError

TYPES = list(blocks.BLOCK)
# Types gguf-py 0.19 can encode; the K-quants and IQ4 formats it can only decode.
GGUF_CAN_QUANTIZE = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")


def reference(raw: np.ndarray, qtype: str, shape) -> np.ndarray:
    data = raw.reshape(-1).view(np.uint8)
    if qtype == "f32":
        data = data.view(np.float32)
    elif qtype == "f16":
        data = data.view(np.float16)
    else:
        data = data.reshape(-1, blocks.BLOCK[qtype][1])  # gguf-py wants whole-block rows
    return np.asarray(gq.dequantize(data, blocks.GGML_TYPE[qtype]), np.float32).reshape(shape)


def random_blocks(qtype: str, n_blocks: int, rng) -> np.ndarray:
    """Random but valid block bytes: every bit pattern, finite f16 scale fields."""
    elems, size = blocks.BLOCK[qtype]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    lay = blocks.LAYOUT.get(qtype, {})
    for field in ("d", "dmin", "m"):
        if field in lay:
            off = lay[field]
            vals = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
            b[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return b


@pytest.mark.parametrize("qtype", [t for t in TYPES if t in GGUF_CAN_QUANTIZE])
@pytest.mark.parametrize("shape", [(3, 256), (4, 2, 512), (1024,)])
def test_gguf_quantize_then_our_dequantize(qtype, shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    raw = np.ascontiguousarray(gq.quantize(x, blocks.GGML_TYPE[qtype])).view(np.uint8)
    ours = blocks.dequantize(raw, qtype, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in ("f32", "f16", "bf16")])
def test_random_blocks_match_gguf(qtype):
    rng = np.random.default_rng(2)
    elems, _ = blocks.BLOCK[qtype]
    shape = (6, 2 * blocks.QK_K)
    raw = random_blocks(qtype, 6 * 2 * blocks.QK_K // elems, rng)
    np.testing.assert_array_equal(blocks.dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", TYPES)
def test_our_quantize_roundtrip(qtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 512)) * 0.05).astype(np.float32)
    raw = block_encode.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.nbytes == blocks.nbytes(qtype, x.shape)
    ours = blocks.dequantize(raw, qtype, x.shape)
    np.testing.assert_array_equal(ours, reference(raw, qtype, x.shape))
    # Quantization error stays a small fraction of the data's scale.
    bits = {"q2_k": 2, "q3_k": 3, "q4_0": 4, "q4_1": 4, "q4_k": 4, "iq4_nl": 4, "iq4_xs": 4,
            "q5_0": 5, "q5_1": 5, "q5_k": 5, "q6_k": 6, "q8_0": 8, "mxfp4": 4}.get(qtype, 10)
    assert np.abs(ours - x).max() < 0.05 * 2.0 ** (4 - bits) * 4


def test_typed_float_inputs():
    x = np.arange(64, dtype=np.float32).reshape(2, 32) / 7
    np.testing.assert_array_equal(blocks.dequantize(x, "f32", (2, 32)), x)
    np.testing.assert_array_equal(blocks.dequantize(x.astype(np.float16), "f16", (2, 32)),
                                  x.astype(np.float16).astype(np.float32))


def test_nbytes_and_layout_constants():
    assert blocks.nbytes("q4_k", (3, 512)) == 3 * 2 * 144
    assert blocks.nbytes("f16", (7, 3)) == 42
    for name, (elems, size) in blocks.BLOCK.items():
        assert gguf.GGML_QUANT_SIZES[blocks.GGML_TYPE[name]] == (elems, size)
        assert blocks.qtype_name(blocks.GGML_TYPE[name]) == name


def test_bad_sizes_and_types_raise():
    with pytest.raises(GGUFError, match="multiple of 32"):
        blocks.dequantize(np.zeros(34, np.uint8), "q8_0", (2, 16))
    with pytest.raises(GGUFError, match="needs 68 bytes"):
        blocks.dequantize(np.zeros(34, np.uint8), "q8_0", (2, 32))
    with pytest.raises(GGUFError, match="multiple of 256"):
        blocks.nbytes("q6_k", (4, 128))
    with pytest.raises(GGUFError, match="unknown quantization type"):
        blocks.dequantize(np.zeros(4, np.uint8), "iq2_xxs", (1, 256))
    with pytest.raises(GGUFError, match="IQ2_XXS"):
        blocks.qtype_name(gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(GGUFError):
        block_encode.quantize(np.zeros((2, 100), np.float32), "q4_0")


@pytest.mark.filterwarnings("ignore:overflow encountered")   # e = 255: inf, in gguf-py too
def test_mxfp4_every_exponent_and_level_matches_gguf():
    """MXFP4 (gpt-oss experts): all 256 shared exponents, the denormal ones (e < 2) and
    the largest included, each with all 16 levels in both nibbles, bit for bit."""
    e = np.arange(256, dtype=np.uint8)
    qs = np.tile(np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4), (256, 1))
    raw = np.concatenate([e[:, None], qs], axis=1)
    shape = (256, 32)
    ours = blocks.dequantize(raw, "mxfp4", shape)
    np.testing.assert_array_equal(ours.view(np.uint32), reference(raw, "mxfp4", shape).view(np.uint32))
    assert ours[0, 1] > 0 and ours[0, 1] < np.finfo(np.float32).tiny    # a denormal scale
    assert ours[252, 7] == np.float32(12 * 2.0 ** 124)          # the largest finite value
    assert np.isinf(ours[255, 7])                                # 12 * 2^127 overflows f32
