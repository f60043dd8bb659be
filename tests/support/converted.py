"""Tiny random models built by transformers and written to GGUF by an independent writer:
llama.cpp's own convert_hf_to_gguf.py, from the llama-cpp-python sdist on PyPI (its
vendored llama.cpp, with the gguf-py it ships), run in a child process.

    path, hf_dir = convert(tmp_path, "gemma4", build_gemma4())

The sdist is fetched once with ``pip download`` into ``$TOYGRAPH_CACHE/models`` and only
the converter, its ``conversion/`` package and ``gguf-py`` are unpacked; TOYGRAPH_OFFLINE=1
skips the tests that need it when it is not there yet.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from toygraph import environment
from toygraph.models.catalog import cache_dir

SDIST = "llama-cpp-python==0.3.36"
UNPACKED = "llama-cpp-python-0.3.36-convert"
KEEP = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
        "vendor/llama.cpp/gguf-py/")


def converter() -> Path:
    """The folder holding llama.cpp's convert_hf_to_gguf.py (fetched once)."""
    root = cache_dir() / UNPACKED
    script = root / "convert_hf_to_gguf.py"
    if script.is_file():
        return root
    if environment.get("TOYGRAPH_OFFLINE"):
        pytest.skip("llama.cpp's converter is not cached and TOYGRAPH_OFFLINE is set")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                               ":all:", "-q", "-d", tmp, SDIST], capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            pytest.skip(f"cannot fetch {SDIST}: {proc.stderr.strip()[-300:]}")
        partial = root.with_name(f"{root.name}.{os.getpid()}.partial")
        with tarfile.open(archives[0]) as tf:
            for member in tf.getmembers():
                rel = member.name.split("/", 1)[1] if "/" in member.name else ""
                if member.isfile() and rel.startswith(KEEP):
                    member.name = rel[len("vendor/llama.cpp/"):]
                    tf.extract(member, partial, filter="data")
        os.replace(partial, root)
    return root


# Runs the converter with its BPE pre-tokenizer detection answered by name: it recognises a
# vocabulary by hashing how the tokenizer splits a test text, and a tiny test vocabulary is in
# no table. Only the name written to tokenizer.ggml.pre depends on it, no tensor.
_WITH_PRE = """import runpy, sys
import conversion.base as base
script, pre = sys.argv[1:3]
sys.argv = [script] + sys.argv[3:]
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(script, run_name="__main__")
"""


def convert(folder: Path, name: str, model, tokenizer, *, pre: str | None = None,
            args: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Save ``model`` (a transformers model) and ``tokenizer`` under ``folder/name`` and
    convert them to ``folder/name.gguf`` in f32; returns (gguf path, HF folder). ``pre``
    names the BPE pre-tokenizer of a byte-level vocabulary (see _WITH_PRE)."""
    root = converter()
    hf = folder / name
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    out = folder / f"{name}.gguf"
    env = dict(os.environ, PYTHONPATH=f"{root / 'gguf-py'}{os.pathsep}{root}")
    head = [sys.executable, "-c", _WITH_PRE, str(root / "convert_hf_to_gguf.py"), pre] if pre \
        else [sys.executable, str(root / "convert_hf_to_gguf.py")]
    proc = subprocess.run([*head, str(hf), "--outtype", "f32", "--outfile", str(out), *args],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, hf


def tiny_sentencepiece_tokenizer(tokenizer_class, pad_to: int = 0):
    """A Gemma-style byte-fallback vocabulary of 316 tokens: specials, 256 bytes, letters;
    then unused tokens up to ``pad_to`` (benchmarks: a real vocabulary's size, which the
    converter's Gemma path takes from the tokenizer)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + letters + ["▁"] + ["▁" + c for c in letters]
    tokens += [f"<unused{i}>" for i in range(pad_to - len(tokens))]
    return tokenizer_class(vocab={t: i for i, t in enumerate(tokens)},
                           merges=[("▁", c) for c in letters])


def hf_model(hf_dir):
    """transformers' float32 model from its own folder (the weights the GGUF was made from)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def check_adapter_loss(path, hf_dir, adapter_dir, tokens, what: str) -> None:
    """The loss with the PEFT adapter in ``adapter_dir``: toygraph's equals PEFT's on the
    Hugging Face model within 1e-4, and the adapter moves it far beyond that."""
    import peft
    from test_arch_models import reference_loss
    from toygraph.inference.language_model import LanguageModel
    mine, _ = LanguageModel(path, adapter_dir=adapter_dir).loss(tokens.tolist())
    base, _ = LanguageModel(path).loss(tokens.tolist())
    ref = reference_loss(peft.PeftModel.from_pretrained(hf_model(hf_dir), str(adapter_dir)), tokens)
    print(f"{what}: base {base:.7f} adapter: toygraph {mine:.7f} peft {ref:.7f}")
    assert abs(mine - ref) <= 1e-4 * abs(ref) and abs(mine - base) > 100 * 1e-4 * ref


def check_checkpointing(path, targets, seq=12) -> None:
    """Three LoRA steps with activation checkpointing give the very losses they give without."""
    import numpy as np
    from toygraph.core.optimizer import hp_row
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    m = GGUFModel(path)
    tokens = np.random.default_rng(0).integers(0, m.config.n_vocab, size=(1, 2, seq)).astype(np.int32)
    labels = np.concatenate([tokens[..., 1:], np.full((1, 2, 1), -1)], -1).astype(np.int32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (1, 2, 1))
    losses = {}
    for checkpoint in (False, True):
        recipe = LoRA(targets=targets, rank=4, alpha=8)
        recipe.realize(m, m.config, RecipeOptions(seq_len=seq, batch=2,
                                                  checkpoint_activations=checkpoint))
        losses[checkpoint] = [recipe.step(tokens, positions, labels,
                                          hp_row(t, 1e-2, 0.9, 0.999, 1e-8, 0.0), is_first=t == 1)
                              for t in (1, 2, 3)]
    assert losses[True] == losses[False] and losses[True][0] != losses[True][2]
