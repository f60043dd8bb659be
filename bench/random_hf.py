"""Random Qwen3.5- and Gemma-4-shaped models for benchmarks: built by transformers at the
real models' layer shapes and vocabularies (fewer layers, so a CPU step fits in seconds),
saved as a Hugging Face folder and written to GGUF by llama.cpp's convert_hf_to_gguf.py (as
the tests do: tests/support/converted.py). toygraph reads the GGUF, torch + PEFT the folder: the
same f32 weights on both sides (transformers cannot read these architectures from GGUF).

The shapes are the published configs' (Qwen3.5-0.8B, Gemma-4-E2B) with one period of
their layer pattern: Qwen3.5's three Gated DeltaNet layers and one gated full-attention
layer; Gemma 4's four sliding layers and one global one, without KV sharing (it needs more
layers than one period). The tokenizers are tiny, padded with unused tokens to the real
vocabulary's size (the converter pads Qwen's itself, and cuts Gemma's embeddings to the
tokenizer's size), so the embeddings and the head have the real sizes.

>>> gguf, hf_dir = random_hf_model("qwen35-0.8b-shape", Path("/tmp/bench"))   # doctest: +SKIP
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

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
SHAPES = {"qwen35-0.8b-shape": ("qwen35", QWEN35_08B), "gemma4-e2b-shape": ("gemma4", GEMMA4_E2B)}


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
    """(GGUF path, Hugging Face folder) of shape ``name`` (a key of SHAPES), written once
    under ``cache/name``."""
    folder = cache / name
    gguf = folder / f"{name}.gguf"
    if gguf.is_file():
        return gguf, folder / name
    sys.path.insert(0, str(HERE.parent / "tests"))   # the converter the tests use
    from support.converted import convert
    arch, dims = SHAPES[name]
    model, tok = _build(arch, dims)
    folder.mkdir(parents=True, exist_ok=True)
    partial, hf = convert(folder, name + ".partial", model, tok,
                          pre="qwen35" if arch == "qwen35" else None,
                          args=("--no-mtp",) if arch == "qwen35" else ())
    hf.rename(folder / name)
    partial.rename(gguf)
    return gguf, folder / name
