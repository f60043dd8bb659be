"""toygraph/cpu/decode.h through cpu/block_tensor.py: the engine's block decoders give
blocks.dequantize's values bit for bit (and gguf-py's), for every format the numpy backend
can keep quantized; rows alone decode like the whole; the numpy fallback takes over
without a library."""
import gguf.quants as gq
import numpy as np
import pytest

from toygraph.errors import GGUFError
from toygraph.cpu import block_tensor as decode, engine
from toygraph.gguf import block_encode, blocks
from test_blocks import random_blocks, reference

BLOCK_TYPES = [t for t in engine.FORMATS if t not in ("f16", "bf16")]


def encoded(qtype: str, shape, seed: int = 0):
    """A random tensor of ``shape`` as ``qtype`` bytes (what a GGUF file holds)."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 0.05).astype(np.float32)
    return block_encode.quantize(x, qtype)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def lib():
    if engine.library() is None:
        pytest.skip("no host C++ compiler: the numpy fallback is all there is")
    return engine.library()


@pytest.mark.parametrize("qtype", engine.FORMATS)
def test_c_decoder_equals_numpy_and_gguf_py(lib, qtype):
    shape = (7, 3 * blocks.QK_K)   # 7 rows: the threads' block ranges split mid-row
    raw = encoded(qtype, shape)
    out = np.full(shape, np.nan, np.float32)
    decode.dequantize_into(raw, qtype, shape, out)
    np.testing.assert_array_equal(bits(out), bits(blocks.dequantize(raw, qtype, shape)))
    np.testing.assert_array_equal(bits(out), bits(reference(raw, qtype, shape)))


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_every_bit_pattern_of_the_quants(lib, qtype):
    """Random block bytes (all values, finite scales), a tensor big enough to be decoded on
    every thread."""
    elems, _ = blocks.BLOCK[qtype]
    shape = (64, 4 * blocks.QK_K)
    raw = random_blocks(qtype, shape[0] * shape[1] // elems, np.random.default_rng(3))
    out = np.empty(shape, np.float32)
    decode.dequantize_into(raw, qtype, shape, out)
    np.testing.assert_array_equal(bits(out), bits(reference(raw, qtype, shape)))


def test_every_f16_and_bf16_value_including_subnormals_inf_and_nan(lib):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for qtype in ("f16", "bf16"):
        out = np.empty(every.size, np.float32)
        decode.dequantize_into(every.view(np.uint8), qtype, (every.size,), out)
        want = blocks.dequantize(every.view(np.uint8), qtype, (every.size,))
        np.testing.assert_array_equal(bits(out), bits(want))
    # the f16 reference is numpy's own conversion (signalling NaNs kept as they are)
    np.testing.assert_array_equal(
        bits(every.view(np.float16).astype(np.float32)),
        bits(decode.dequantize_into(every.view(np.uint8), "f16", (every.size,),
                                    np.empty(every.size, np.float32))))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "f16"])
def test_rows_decode_like_the_whole_tensor(qtype):
    shape = (40, 512)
    t = decode.BlockTensor(encoded(qtype, shape, seed=5), qtype, shape)
    whole = t.decode_into(np.empty(shape, np.float32))
    ids = np.array([[3, 39], [0, 3]], np.int32)
    rows = t.decode_rows(ids, np.empty((2, 2, 512), np.float32))
    np.testing.assert_array_equal(bits(rows.reshape(-1, 512)), bits(whole[ids.reshape(-1)]))
    np.testing.assert_array_equal(np.asarray(t), whole)


def test_f64_buffers_and_the_numpy_path_give_the_same_values():
    shape = (4, 256)
    raw = encoded("q6_k", shape)
    want = blocks.dequantize(raw, "q6_k", shape)
    f64 = decode.dequantize_into(raw, "q6_k", shape, np.empty(shape, np.float64))
    np.testing.assert_array_equal(f64, want.astype(np.float64))
    slow = decode.dequantize_into(raw, "q6_k", shape, np.empty(shape, np.float32),
                                  native_code=False)
    np.testing.assert_array_equal(bits(slow), bits(want))


def test_without_a_compiler_it_warns_once_and_decodes_with_numpy(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "cache"))
    engine.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="toygraph.cpu.engine"):
            shape = (2, 256)
            raw = encoded("q4_k", shape)
            out = decode.dequantize_into(raw, "q4_k", shape, np.empty(shape, np.float32))
        np.testing.assert_array_equal(bits(out), bits(blocks.dequantize(raw, "q4_k", shape)))
        assert engine.library() is None
        assert "take the numpy path" in caplog.text
    finally:
        engine.library.cache_clear()


def test_wrong_sizes_are_one_line_errors():
    raw = encoded("q8_0", (2, 64))
    with pytest.raises(GGUFError, match="out has shape"):
        decode.dequantize_into(raw, "q8_0", (2, 64), np.empty((2, 32), np.float32))
    with pytest.raises(GGUFError, match="needs 68 bytes, got 136"):
        decode.BlockTensor(raw, "q8_0", (1, 64))


def test_gguf_py_agrees_on_a_q8_0_file_layout():
    """An independent encoder (gguf-py) feeding the C decoder."""
    x = (np.random.default_rng(9).standard_normal((3, 64)) * 0.1).astype(np.float32)
    raw = np.ascontiguousarray(gq.quantize(x, blocks.GGML_TYPE["q8_0"])).view(np.uint8)
    out = decode.dequantize_into(raw, "q8_0", x.shape, np.empty(x.shape, np.float32))
    np.testing.assert_array_equal(bits(out), bits(reference(raw, "q8_0", x.shape)))


@pytest.mark.slow
def test_a_compiler_without_march_native_builds_for_its_default_target(monkeypatch, tmp_path,
                                                                          caplog):
    """A g++ that refuses -march=native (some cross or older compilers): the engine is
    built for the compiler's default target instead of falling back to numpy."""
    import shutil
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "-march=native" ] && exit 1; done\n'
                       f'exec {gxx} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "cache"))
    engine.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="toygraph.cpu.engine"):
            assert engine.library() is not None
        assert "default target" in caplog.text
        shape = (2, 256)
        raw = encoded("q4_k", shape)
        out = decode.dequantize_into(raw, "q4_k", shape, np.empty(shape, np.float32))
        np.testing.assert_array_equal(bits(out), bits(blocks.dequantize(raw, "q4_k", shape)))
    finally:
        engine.library.cache_clear()


def test_the_target_setting_chooses_the_engines_instruction_set(monkeypatch):
    """TOYGRAPH_CPU_TARGET reaches the build as its -march (native by default), and a value
    outside its choices is the setting's one-line error, not a build."""
    from toygraph.errors import SettingError
    from types import SimpleNamespace
    targets = []

    def load(text, target="-march=native"):
        targets.append(target)
        return SimpleNamespace(tg_set_threads=lambda n: n)

    monkeypatch.setattr(engine, "load", load)
    engine.library.cache_clear()
    try:
        engine.library()
        monkeypatch.setenv("TOYGRAPH_CPU_TARGET", "x86-64-v3")
        engine.library.cache_clear()
        engine.library()
        monkeypatch.setenv("TOYGRAPH_CPU_TARGET", "avx2")
        engine.library.cache_clear()
        with pytest.raises(SettingError, match="TOYGRAPH_CPU_TARGET must be one of"):
            engine.library()
    finally:
        engine.library.cache_clear()
    assert targets == ["-march=native", "-march=x86-64-v3"]
