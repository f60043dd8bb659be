"""Tiny random mixture-of-experts models as the independent references of the MoE tests:
built by transformers from a config, saved as a Hugging Face directory, and converted to
GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (not by toygraph or its fixtures).

The outputs are committed under tests/support/files/moe/<name>/ (config.json, model.safetensors,
tokenizer files, model.gguf), so the tests need neither network nor llama.cpp. Regenerate
them with::

    python tests/support/moe_references.py [--llama-cpp DIR]

DIR is a llama.cpp checkout; without it the script fetches llama-cpp-python's source
distribution with ``pip download`` (it vendors llama.cpp) into a temporary folder.

One change is made to the converter at run time, and only to its vocabulary step: a tiny
byte-level tokenizer has no entry in ``get_vocab_base_pre``'s table of known pre-tokenizer
hashes (it refuses unknown ones), so that method is made to answer the family's real
pre-tokenizer name. Tensors and model metadata are written by the converter unchanged.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent / "files" / "moe"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"   # the sdist the committed files came from
VOCAB = 288          # 256 byte tokens, 3 specials, the rest padding the converter names
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: name -> (transformers config class name, its arguments, converter's pre-tokenizer name)
MODELS = {
    # 6 experts, top-2, renormalised top-k weights, GQA 4:2, head_dim * heads != hidden.
    "qwen3moe": ("Qwen3MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "qwen2"),
    # Qwen2-MoE: Qwen2 attention (q/k/v biases), 6 experts, top-2 softmax weights not
    # renormalised (norm_topk_prob false, as the released Qwen1.5-MoE and Qwen2-57B), and a
    # shared expert of its own width gated per token by sigmoid(x . w).
    "qwen2moe": ("Qwen2MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "qwen2"),
    # 6 experts, top-2 then softmax, clamped SwiGLU, biases everywhere, attention sinks,
    # sliding window 6 (< the tests' 16 tokens) on layer 0, full attention on layer 1, and
    # YaRN whose frequency ramp lands inside the 8 rotary pairs (a small base and original
    # context). "truncate": true is llama.cpp's YaRN (ggml_rope_yarn_corr_dims floors and
    # ceils the correction range; the GGUF has no key for it); see test_moe_models.py.
    "gpt-oss": ("GptOssConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=6, rms_norm_eps=1e-5, attention_bias=True,
        max_position_embeddings=2048, tie_word_embeddings=False, swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                         "original_max_position_embeddings": 512}), "gpt-4o"),
}


def _tokenizer(out: Path) -> None:
    """A byte-level BPE: the 256 byte symbols, a few merges, then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    vocab = {s: i for i, s in enumerate(sorted(ByteLevel.alphabet(), key=ord))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0],
        "bos_token": None, "model_max_length": 256}))


def _randomize(model, seed: int) -> None:
    """Weights large enough that attention, routing and every expert matter: N(0, 0.2)
    matrices (router logits of std ~1.6: every chosen expert weighs), norm weights near 1;
    gpt-oss's sinks and gate/up experts (and their biases) N(0, 1), so sinks take a share
    of every row and the SwiGLU clamp at 7 is active."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.copy_(1 + 0.1 * torch.randn(prm.shape, generator=gen))
            elif name.endswith("sinks"):   # per-head logits of the same order as the scores
                prm.copy_(torch.randn(prm.shape, generator=gen))
            elif name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
                prm.copy_(torch.randn(prm.shape, generator=gen))  # gpt-oss: past the clamp
            else:
                prm.copy_(0.2 * torch.randn(prm.shape, generator=gen))


def build_hf(name: str, out: Path, seed: int = 0) -> None:
    import torch
    import transformers
    cls, kwargs, _ = MODELS[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs))
    _randomize(model.float(), seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _tokenizer(out)


def _llama_cpp(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "-q", "-d", str(tmp), LLAMA_CPP_PYTHON]
    subprocess.run(cmd, check=True)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp, filter="data")
    return next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))


_RUN_CONVERTER = """
import runpy, sys
sys.path.insert(0, {root!r})
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outfile", {dst!r}, "--outtype", "f32"]
runpy.run_path({script!r}, run_name="__main__")
"""


def convert(name: str, hf_dir: Path, llama_cpp: Path) -> Path:
    """llama.cpp's converter, f32 output (the parity tests compare f32 math)."""
    dst = hf_dir / "model.gguf"
    code = _RUN_CONVERTER.format(root=str(llama_cpp), pre=MODELS[name][2], src=str(hf_dir),
                                 dst=str(dst), script=str(llama_cpp / "convert_hf_to_gguf.py"))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=llama_cpp)
    return dst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp checkout (default: fetch)")
    ap.add_argument("names", nargs="*", default=list(MODELS))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.llama_cpp or _llama_cpp(Path(tmp))
        for name in args.names:
            out = HERE / name
            build_hf(name, out)
            print(name, "->", convert(name, out, root))


def requantize(name: str, dst: Path, types: dict[str, str]) -> Path:
    """The committed GGUF ``name`` rewritten with gguf-py, tensors whose name contains a key
    of ``types`` quantized by ``gguf.quants.quantize`` to that type ("q8_0", ...),
    everything else (metadata included) copied as it is."""
    import gguf
    reader = gguf.GGUFReader(gguf_path(name), "r")
    writer = gguf.GGUFWriter(dst, reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        fmt = next((f for key, f in types.items() if key in t.name), None)
        if fmt is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            qtype = gguf.GGMLQuantizationType[fmt.upper()]
            writer.add_tensor(t.name, gguf.quants.quantize(np.asarray(t.data, np.float32), qtype),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def reference_model(name: str):
    """The committed Hugging Face model ``name`` (float32, eval mode)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(HERE / name), dtype=torch.float32).eval()


def gguf_path(name: str) -> Path:
    return HERE / name / "model.gguf"


def random_tokens(n_vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, size=(batch, seq)).astype(np.int32)


if __name__ == "__main__":
    main()
