"""Block formats end to end: the CUDA decoders (blocks.cuh, compiled for the host) on random
blocks against gguf-py, and a tiny model whose tensors mix block types the way K_M/K_S
downloads do — loaded, compared with transformers, planned for the GPU in block format,
and trained a few LoRA steps."""
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import gguf.quants as gq
from support.cudaemu import (BLOCK_FORMATS, QUANT_PATTERNS, host_library, lora_graph,
                             quant_kernels, training_plan)
from test_llama import transformers_loss
from test_blocks import random_blocks
from toygraph.gguf import block_encode, blocks
from toygraph.cuda import devmem
from toygraph.ops.lowering import dispatch, registry
from support.kernelsrc import KERNEL_NAMES
from toygraph.ops.lowering import generate
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS
from toygraph.ops.lowering.sources import kernel_names, layout_defines, read_source
from toygraph.fixtures.tiny_models import write_tiny_llama
from toygraph.models.model import GGUFModel
from toygraph.core.optimizer import hp_row
from toygraph.recipes import LoRA, RecipeOptions

OPS_DIR = Path(dispatch.__file__).parents[1]
BLOCK_TYPES = sorted(set(blocks.BLOCK) - {"f32", "f16", "bf16"})
NEW_TYPES = ("q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "iq4_xs")


@pytest.mark.parametrize("fmt", BLOCK_TYPES)
def test_cuda_decoders_match_gguf_py_on_random_blocks(fmt, host_decoder):
    """Every bit pattern of the quantized fields (finite f16 scales), decoded by blocks.cuh
    through rows as the fused kernels read them, equals gguf-py bit for bit."""
    rng = np.random.default_rng(12)
    elems, size = blocks.BLOCK[fmt]
    rows, cols = 24, 2 * blocks.QK_K
    data = random_blocks(fmt, rows * cols // elems, rng)
    want = np.asarray(gq.dequantize(data, blocks.GGML_TYPE[fmt]), np.float32).ravel()
    got = np.empty(rows * cols, np.float32)
    raw = np.ascontiguousarray(data).ravel()
    assert host_decoder(fmt.encode(), raw.ctypes.data, rows * cols, rows,
                        blocks.nbytes(fmt, (1, cols)), got.ctypes.data) == 0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_iq4nl_levels_are_ggmls_and_reach_the_kernels_only_through_layout_defines():
    assert blocks.MXFP4_VALUES == tuple(gq.MXFP4.kvalues)
    assert blocks.IQ4NL_VALUES == tuple(gq.IQ4_NL.kvalues)
    levels = ", ".join(map(str, blocks.IQ4NL_VALUES))
    assert f"#define TG_IQ4NL_VALUES {levels}\n" in layout_defines()
    assert "{TG_IQ4NL_VALUES}" in read_source("blocks.cuh")
    assert "-127, -104" not in read_source("blocks.cuh")    # no hand-written copy


# One tensor role per type, as a Q4_K_M/Q3_K_M file mixes them: ffn_down's rows (n_ff = 288,
# not a multiple of 256) take a 32-element fallback type as llama.cpp's quantizer does.
MIXED_TYPES = {
    "token_embd": "q3_k", "output": "iq4_xs",
    "attn_q": "q2_k", "attn_k": "q4_k", "attn_v": "q5_1", "attn_output": "iq4_nl",
    "ffn_gate": "q3_k", "ffn_up": "q6_k", "ffn_down": "q5_0",
}


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    return write_tiny_llama(path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=288,
                            tied=False, weight_types=MIXED_TYPES, std=0.05)


def test_mixed_model_carries_every_new_type(mixed_model):
    m = GGUFModel(mixed_model)
    types = {m.tensor(n).qtype for n in m.tensor_names()}
    assert set(NEW_TYPES) <= types
    assert m.tensor("blk.1.ffn_down.weight").shape == (256, 288)


def _batch(vocab, B=2, T=16, seed=0):
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(B, T)).astype(np.int32)
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    labels = np.concatenate([tokens[:, 1:], np.full((B, 1), -1, np.int32)], 1)
    return tokens, positions, labels


@pytest.mark.reference
def test_mixed_model_matches_transformers_and_trains(mixed_model):
    """transformers dequantizes every tensor with gguf-py; LoRA's B starts at zero, so the
    recipe's first loss is the base model's. Then a few LoRA steps on one batch: finite and
    falling."""
    m = GGUFModel(mixed_model)
    tokens, positions, labels = _batch(m.config.n_vocab)
    recipe = LoRA(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8)
    recipe.realize(m, m.config, RecipeOptions(seq_len=16, batch=2, seed=0))
    total, count = recipe.evaluate(tokens, positions, labels)
    mine, ref = total / count, transformers_loss(mixed_model, tokens)
    print(f"mixed block types: toygraph {mine:.7f} transformers {ref:.7f} "
          f"rel {abs(mine - ref) / ref:.2e}")
    assert abs(mine - ref) / ref <= 1e-4
    losses = [recipe.step(tokens[None], positions[None], labels[None], hp_row(t, 1e-2),
                          is_first=(t == 1))
              for t in range(1, 6)]
    print("LoRA losses:", " ".join(f"{x:.5f}" for x in losses))
    assert np.all(np.isfinite(losses)) and abs(losses[0] - mine) <= 1e-6 * mine
    assert losses[-1] < losses[0] - 0.05 and all(b < a for a, b in zip(losses, losses[1:]))


def test_mixed_model_stays_in_block_format_on_the_gpu_plan(mixed_model):
    """The CUDA plan keeps every frozen weight of every type in its blocks, and each node
    reading one lowers to the fused kernel of that type."""
    g = lora_graph(mixed_model, targets=("q", "v", "down"))
    order, pinned, plan, outputs = training_plan(g)
    consts = [t for t in order if t.role == "const" and t.storage != "f32"]
    assert {t.storage for t in consts} == set(MIXED_TYPES.values())
    mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
    assert {t.id for t in consts} == set(mem.raw_consts)
    addr = {t.id: (i + 1) << 20 for i, t in enumerate(order)}
    seen = set()
    for node in order:
        raw = [s for s in node.srcs if s.id in mem.raw_consts] if node.op else []
        if raw:
            kernels = [launch.kernel for launch in dispatch.lower(
                node, lambda t: addr[t.id], 1 << 40, frozenset(mem.raw_consts))]
            fused = set(quant_kernels(raw[0].storage).values())   # (matmul_add's add after it)
            assert set(kernels) & fused, (node.op, kernels)
            assert set(kernels) <= fused | {"tg_matmul_add_epilogue"}, (node.op, kernels)
            seen.add(raw[0].storage)
    assert seen == set(MIXED_TYPES.values())


def test_quant_kernel_table_covers_every_block_format():
    assert set(BLOCK_FORMATS) == set(registry.block_storage())
    for pattern in QUANT_PATTERNS.values():
        assert tuple(FORMAT_KERNELS[pattern]) == BLOCK_FORMATS, pattern
        for fmt, n in FORMAT_KERNELS[pattern].items():
            assert n in KERNEL_NAMES, f"{fmt}: kernel {n} missing from the sources"


# --- one list of block formats: the X-macro TG_BLOCK_FORMATS, and the names it spells --------
def test_format_kernels_is_current():
    """format_kernels.py spells out the kernels of every TG_BLOCK_FORMATS line of the .cu
    files for every format; after a new format or per-format kernel, run
    ``python -m toygraph.ops.lowering.generate``."""
    assert generate.TARGET.read_text() == generate.format_kernels_text(), (
        "toygraph/ops/lowering/format_kernels.py is out of date: run "
        "python -m toygraph.ops.lowering.generate")
    assert all(tuple(kernels) == BLOCK_FORMATS for kernels in FORMAT_KERNELS.values())
    assert FORMAT_KERNELS["tg_tc_qmm_nt_<fmt>_bf16"]["q4_k"] == "tg_tc_qmm_nt_q4_k_bf16"
    assert FORMAT_KERNELS["tg_deq_<fmt>"]["bf16"] == "tg_deq_bf16"


def test_no_kernel_file_lists_the_block_formats_itself():
    """The per-format kernels are spelled out only in the X-macro's expansion: no .cu names
    a format's decoder (TgQ4_K ...) but blocks.cuh, which defines them."""
    for path in sorted(OPS_DIR.glob("*/*.cu")):
        text = path.read_text()
        assert not re.search(r"\bTg(Q\d|IQ\d|MXFP4|F16|BF16)\w*\b", text), path.name


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_the_kernel_names_read_from_the_source_are_the_preprocessors(precision):
    """kernel_names expands TG_BLOCK_FORMATS itself (the host executor exports, and the
    signature tests check, what it finds); g++ -E's expansion defines the same kernels."""
    from toygraph.ops.lowering.sources import _KERNEL, backend_source
    source = backend_source(precision)
    expanded = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-"], input=source, text=True,
                              capture_output=True, check=True).stdout
    assert sorted(_KERNEL.findall(expanded)) == sorted(kernel_names(source))
    assert "tg_qmm_nt_mxfp4" in kernel_names(source)


def test_kernels_take_block_layouts_from_quant_py():
    defines = layout_defines()
    for fmt in BLOCK_FORMATS:
        elems, size = blocks.BLOCK[fmt]
        assert f"#define TG_{fmt.upper()}_QK {elems}\n" in defines
        assert f"#define TG_{fmt.upper()}_BYTES {size}\n" in defines
        for field, off in blocks.LAYOUT.get(fmt, {}).items():
            assert f"#define TG_{fmt.upper()}_{field.upper()} {off}\n" in defines


# --- blocks.cuh's decoders, compiled for the host and checked bit for bit against blocks.py ----
_HOST_SHIM = r"""
#include <math.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
static float tg_keep(float v) { volatile float r = v; return r; }
static float __fmul_rn(float a, float b) { return tg_keep(a * b); }
static float __fadd_rn(float a, float b) { return tg_keep(a + b); }
static float __fsub_rn(float a, float b) { return tg_keep(a - b); }
static float tg_load_half(const unsigned char* p) {   // exact IEEE half -> float
    unsigned h = p[0] | (p[1] << 8), e = (h >> 10) & 31, m = h & 1023;
    float f = e == 0 ? ldexpf((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), (int)e - 25);
    return (h >> 15) ? -f : f;
}
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static float tg_bf16_to_float(unsigned short h) {
    unsigned u = ((unsigned)h) << 16; float f; memcpy(&f, &u, 4); return f;
}
"""


_HOST_DRIVER = r"""
template <class F> static void run(const unsigned char* raw, long long n, int rows,
                                   int row_bytes, float* out) {
    long long cols = n / rows;   // decode through rows, as the fused kernels do
    for (long long e = 0; e < n; ++e)
        out[e] = tg_dequant_at<F>(raw + (e / cols) * row_bytes, e % cols);
}
extern "C" int decode(const char* f, const unsigned char* raw, long long n, int rows,
                      int row_bytes, float* out) {
#define TG_CASE(fmt, NAME) \
    if (!strcmp(f, #fmt)) { run<Tg##NAME>(raw, n, rows, row_bytes, out); return 0; }
    TG_BLOCK_FORMATS(TG_CASE)
    return 1;
}
"""


@pytest.fixture(scope="module")
def host_decoder(tmp_path_factory):
    import ctypes
    fn = host_library(tmp_path_factory, "hostdecode",
                      _HOST_SHIM + layout_defines() + read_source("blocks.cuh") + _HOST_DRIVER,
                      flags=("-ffp-contract=off",)).decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p]
    return fn


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_shared_decoders_match_quant_py_bit_for_bit(fmt, host_decoder):
    rng = np.random.default_rng(11)
    elems = blocks.BLOCK[fmt][0]
    rows, cols = 5, 2 * max(elems, 32)
    x = (rng.normal(size=(rows, cols)) * rng.uniform(0.01, 3, size=(rows, 1))).astype(np.float32)
    raw = np.ascontiguousarray(block_encode.quantize(x, fmt)).reshape(-1).view(np.uint8)
    if fmt in ("f16", "bf16"):  # every finite bit pattern, subnormals and -0 included
        bits = np.arange(1 << 16, dtype=np.uint16)
        bits = bits[np.isfinite(blocks.dequantize(bits, fmt, bits.shape))]
        raw, rows, cols = bits.view(np.uint8), 1, bits.size
    want = blocks.dequantize(raw, fmt, (rows, cols))
    got = np.empty(rows * cols, np.float32)
    assert host_decoder(fmt.encode(), raw.ctypes.data, rows * cols, rows,
                        blocks.nbytes(fmt, (1, cols)), got.ctypes.data) == 0
    np.testing.assert_array_equal(got.view(np.uint32), want.ravel().view(np.uint32))
