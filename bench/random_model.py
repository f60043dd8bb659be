"""Random models for benchmarks, at real models' shapes (the values do not change a step's
speed): one module for every kind the benches write.

- ``write_random_llama``: a Llama-shaped GGUF of any size (``LLAMA1B``, ``LLAMA8B``,
  ``SMOLLM2_SHAPES``), a thin wrapper over ``toygraph.fixtures.tiny_models.write_tiny_llama``
  with a realistic 32k vocabulary (the fixtures' byte-level BPE padded with unused tokens)
  and one weight type (``WTYPES``) for every matrix. Q/K rows are written as generated (no
  llama.cpp permutation): toygraph computes in the GGUF layout with the "normal" rope and
  transformers un-permutes at load, so both compute the same model.
- ``write_random_qwen3moe``: a Qwen3-30B-A3B-shaped GGUF (qwen3moe) of any depth, with
  llama.cpp's Q4_K_M block types (llama_tensor_get_type): q4_k everywhere but the output
  head, attn_v and ffn_down_exps in the "more bits" layers (the first and last eighth, and
  every third in between) in q6_k; norms and the router (never quantized by llama.cpp) in
  f32. Encoding 30e9 random weights would take hours, so each matrix's rows are drawn from
  a pool of 64 rows encoded once per (type, width) with toygraph.gguf.block_encode (valid
  blocks; each expert takes the pool rows in its own order), and tensors are streamed to
  the file one at a time, so memory stays at one tensor.
- ``random_hf_model``: Qwen3.5- and Gemma-4-shaped models built by transformers at the real
  models' layer shapes and vocabularies (one period of their layer pattern: Qwen3.5's three
  Gated DeltaNet layers and one gated full-attention layer; Gemma 4's four sliding layers
  and one global one, without KV sharing), saved as a Hugging Face folder and written to
  GGUF by llama.cpp's convert_hf_to_gguf.py (as the tests do: tests/support/converted.py).
  toygraph reads the GGUF, torch + PEFT the folder: the same f32 weights on both sides. The
  tokenizers are tiny, padded with unused tokens to the real vocabulary's size.

>>> write_random_llama("/tmp/llama1b/llama1b-random-f16.gguf")      # doctest: +SKIP
>>> write_random_qwen3moe("/tmp/moe/qwen3moe-6l.gguf", n_layer=6)   # doctest: +SKIP
>>> gguf, hf_dir = random_hf_model("qwen35-0.8b-shape", Path("/tmp/bench"))   # doctest: +SKIP

As a script: ``python bench/random_model.py OUT.gguf [--shape 1b|8b|smollm2|qwen3moe]
[--wtype f16] [--small] [--layers N]``, or ``--shape qwen35-0.8b-shape|gemma4-e2b-shape``
with OUT the folder to write it under.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
try:
    from toygraph.fixtures.tiny_models import MATRIX_ROLES, tiny_vocab, write_tiny_llama
except ImportError:  # a checkout without `pip install -e .`: fixtures/ is top-level there
    sys.path.insert(0, str(HERE.parent))
    from fixtures.tiny_models import MATRIX_ROLES, tiny_vocab, write_tiny_llama
from toygraph.gguf import block_encode, blocks


# --- Llama-shaped GGUFs ------------------------------------------------------------------------
# Llama-3.2-1B-like dims with a 32k vocabulary: ~1.04e9 matmul weights (incl. the tied head).
LLAMA1B = dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=32000)
# Llama-3.1-8B's dims, vocabulary and untied head: ~8.03e9 matmul weights.
LLAMA8B = dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256,
               tied=False, rope_base=500000.0)
#: Weight types a random model can be written in: every format toygraph reads (the
#: K-quants and IQ4 ones through toygraph.gguf.block_encode).
WTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k",
          "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
# SmolLM2-135M's shapes, for machines without the real GGUF (speed does not depend on values).
SMOLLM2_SHAPES = dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
                      n_ctx=8192, rope_base=100000.0)


def write_random_llama(path, *, n_layer: int = 16, n_embd: int = 2048, n_head: int = 32,
                       n_head_kv: int = 8, n_ff: int = 8192, n_vocab: int = 32000,
                       n_ctx: int = 4096, wtype: str = "f16", tied: bool = True,
                       seed: int = 0, std: float = 0.02, rope_base: float = 10000.0) -> Path:
    """Write a random llama GGUF (every matrix in ``wtype``, one of WTYPES; norms f32)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_llama(path, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                            n_head_kv=n_head_kv, n_ff=n_ff, n_ctx=n_ctx, tied=tied, seed=seed,
                            rope_base=rope_base, n_vocab=n_vocab, std=std,
                            weight_types={role: wtype for role in MATRIX_ROLES})


# --- Qwen3-30B-A3B-shaped (qwen3moe) GGUFs ------------------------------------------------------
QWEN3_30B_A3B = dict(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                     n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936)
_POOL = 64


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layer): Q4_K_M's q6_k layers."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _pool(qtype: str, width: int, rng) -> np.ndarray:
    rows = (rng.standard_normal((_POOL, width)) * 0.02).astype(np.float32)
    return block_encode.quantize(rows, qtype).reshape(_POOL, -1)


def _rows(pool: np.ndarray, n_rows: int, seed: int) -> np.ndarray:
    """n_rows encoded rows drawn from the pool, in an order that depends on seed."""
    idx = (np.arange(n_rows, dtype=np.int64) * 7 + seed * 13 + (np.arange(n_rows) // _POOL)) % _POOL
    return pool[idx]


def write_random_qwen3moe(path, *, n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
                          head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768,
                          n_vocab=151936, seed=0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pools: dict[tuple[str, int], np.ndarray] = {}
    tensors = []  # (name, numpy shape, storage, make())

    def mat(name, shape, qtype, salt):
        key = (qtype, shape[-1])
        if key not in pools:
            pools[key] = _pool(qtype, shape[-1], rng)
        pool = pools[key]
        rows = int(np.prod(shape[:-1]))
        tensors.append((name, shape, qtype,
                        lambda: _rows(pool, rows, salt).reshape(*shape[:-1], -1)))

    def f32(name, shape, std=None):
        r = np.random.default_rng(len(tensors))
        tensors.append((name, shape, "f32", lambda: (np.ones(shape, np.float32) if std is None
                        else (r.standard_normal(shape) * std).astype(np.float32))))

    mat("token_embd.weight", (n_vocab, n_embd), "q4_k", 1)
    for i in range(n_layer):
        b = f"blk.{i}."
        six = "q6_k" if more_bits(i, n_layer) else "q4_k"
        f32(b + "attn_norm.weight", (n_embd,))
        mat(b + "attn_q.weight", (n_head * head_dim, n_embd), "q4_k", 10 * i + 2)
        mat(b + "attn_k.weight", (n_head_kv * head_dim, n_embd), "q4_k", 10 * i + 3)
        mat(b + "attn_v.weight", (n_head_kv * head_dim, n_embd), six, 10 * i + 4)
        mat(b + "attn_output.weight", (n_embd, n_head * head_dim), "q4_k", 10 * i + 5)
        f32(b + "attn_q_norm.weight", (head_dim,))
        f32(b + "attn_k_norm.weight", (head_dim,))
        f32(b + "ffn_norm.weight", (n_embd,))
        f32(b + "ffn_gate_inp.weight", (n_expert, n_embd), std=0.02)
        mat(b + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), "q4_k", 10 * i + 6)
        mat(b + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), "q4_k", 10 * i + 7)
        mat(b + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), six, 10 * i + 8)
    f32("output_norm.weight", (n_embd,))
    mat("output.weight", (n_vocab, n_embd), "q6_k", 9)

    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("random Qwen3-30B-A3B-shaped")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(6144)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens, token_types, merges = tiny_vocab()
    pad = n_vocab - len(tokens)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(pad)])
    w.add_token_types(token_types + [int(gguf.TokenType.UNUSED)] * pad)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    for name, shape, storage, _ in tensors:
        if storage == "f32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            nbytes = blocks.nbytes(storage, shape)
            byte_shape = (*shape[:-1], nbytes // int(np.prod(shape[:-1])))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType[storage.upper()])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in tensors:
        w.write_tensor_data(make())
    w.close()
    return path


# --- Qwen3.5- and Gemma-4-shaped models, through transformers and llama.cpp's converter ---------
QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
                  layer_types=["linear_attention"] * 3 + ["full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                   "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]})
GEMMA4_E2B = dict(vocab_size=262144, hidden_size=1536, intermediate_size=6144,
                  num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                  sliding_window=512, hidden_size_per_layer_input=256,
                  vocab_size_per_layer_input=262144, final_logit_softcapping=30.0,
                  layer_types=["sliding_attention"] * 4 + ["full_attention"],
                  num_kv_shared_layers=0,
                  rope_parameters={"sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional",
                                                      "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1000000.0}})
HF_SHAPES = {"qwen35-0.8b-shape": ("qwen35", QWEN35_08B),
             "gemma4-e2b-shape": ("gemma4", GEMMA4_E2B)}


def _build(arch: str, dims: dict):
    import torch
    import transformers
    torch.manual_seed(0)
    dims = dict(dims, num_hidden_layers=len(dims["layer_types"]), max_position_embeddings=4096)
    if arch == "qwen35":
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
        tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=[])
        tok.add_special_tokens({"eos_token": "<|endoftext|>"})
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**dims))
    else:
        from support.converted import tiny_sentencepiece_tokenizer
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
        tok = tiny_sentencepiece_tokenizer(GemmaTokenizer, pad_to=dims["vocab_size"])
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**dims))
    return model.float().eval(), tok


def random_hf_model(name: str, cache: Path) -> tuple[Path, Path]:
    """(GGUF path, Hugging Face folder) of shape ``name`` (a key of HF_SHAPES), written once
    under ``cache/name``."""
    folder = cache / name
    gguf = folder / f"{name}.gguf"
    if gguf.is_file():
        return gguf, folder / name
    sys.path.insert(0, str(HERE.parent / "tests"))   # the converter the tests use
    from support.converted import convert
    arch, dims = HF_SHAPES[name]
    model, tok = _build(arch, dims)
    folder.mkdir(parents=True, exist_ok=True)
    partial, hf = convert(folder, name + ".partial", model, tok,
                          pre="qwen35" if arch == "qwen35" else None,
                          args=("--no-mtp",) if arch == "qwen35" else ())
    hf.rename(folder / name)
    partial.rename(gguf)
    return gguf, folder / name

# --- the command line ----------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the GGUF to write (a folder for the Hugging Face shapes)")
    ap.add_argument("--shape", default="1b",
                    choices=["1b", "8b", "smollm2", "qwen3moe", *HF_SHAPES])
    ap.add_argument("--wtype", default="f16", choices=WTYPES, help="llama shapes' matrices")
    ap.add_argument("--small", action="store_true", help="2 layers x 256 wide (for a quick check)")
    ap.add_argument("--layers", type=int, help="layers (default: the shape's)")
    a = ap.parse_args(argv)
    if a.shape in HF_SHAPES:
        print(*random_hf_model(a.shape, Path(a.out)))
        return
    if a.shape == "qwen3moe":
        print(write_random_qwen3moe(a.out, **dict(QWEN3_30B_A3B, n_layer=a.layers or 48)))
        return
    dims = dict({"1b": LLAMA1B, "8b": LLAMA8B, "smollm2": SMOLLM2_SHAPES}[a.shape])
    if a.small:
        dims.update(n_layer=2, n_embd=256, n_head=8, n_head_kv=2, n_ff=512)
    if a.layers:
        dims.update(n_layer=a.layers)
    print(write_random_llama(a.out, wtype=a.wtype, **dims))


if __name__ == "__main__":
    sys.exit(main())
