"""Open a Llama-family GGUF file: config from metadata, weights as mmap'd block bytes.

The file is read with ``gguf.GGUFReader``, which memory-maps it: opening parses the
header, metadata and tensor index, and no weight byte is read until a tensor is
dequantized (or bound to a device buffer).

>>> m = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")      # doctest: +SKIP
>>> m.config.n_layer, m.tensor("blk.0.attn_q.weight").shape  # doctest: +SKIP
(30, (576, 576))
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toygraph import quant
from toygraph.errors import GGUFError
# The bounded parser of header, metadata and tensor index (see gguf_reader.py).
from toygraph.gguf_reader import BoundedReader as _Reader, PastEnd as _PastEnd

# Architectures we can run, and the rope layout their Q/K rows are stored in:
# llama.cpp's converter permutes llama Q/K rows for its "normal" (adjacent-pair)
# rope; qwen2 is stored unpermuted and uses the neox (rotate-half) rope.
ROPE_MODE = {"llama": "normal", "qwen2": "neox"}


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rope_dims: int
    rope_mode: str      # "normal" | "neox"
    rms_eps: float
    n_vocab: int
    n_ctx: int
    tied_output: bool   # no output.weight: the LM head reuses token_embd.weight
    qkv_bias: bool      # attn_q/k/v have biases (qwen2)


@dataclass
class WeightTensor:
    """One GGUF tensor: its block-format bytes (a memmap view) and numpy-order shape."""
    name: str
    qtype: str
    shape: tuple[int, ...]
    raw: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 of ``shape`` (reads the mapped bytes)."""
        return quant.dequantize(self.raw, self.qtype, self.shape)


def _plain(field) -> Any:
    """A ReaderField's value as plain Python (str, int, float, bool, or list)."""
    v = field.contents()
    if isinstance(v, np.generic):
        return v.item()
    return v


class GGUFModel:
    """A Llama-family GGUF, validated at open: config, required tensors, types, bounds.

    >>> m = GGUFModel("tiny.gguf")                   # doctest: +SKIP
    >>> w = m.tensor("blk.0.ffn_up.weight")          # doctest: +SKIP
    >>> w.qtype, w.shape, w.dequantize().dtype       # doctest: +SKIP
    ('q8_0', (96, 64), dtype('float32'))
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            self.reader = _Reader(self.path, "r")
        except _PastEnd as e:
            raise GGUFError(f"{self.path}: truncated file: {e}") from None
        except GGUFError as e:
            raise GGUFError(f"{self.path}: {e}") from None
        except Exception as e:  # the reader raises ValueError, KeyError, IndexError, ...
            raise GGUFError(f"{self.path}: not a valid or complete GGUF file ({type(e).__name__}: {e})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._read_config()
        self._validate()

    # -- metadata -----------------------------------------------------------------
    def metadata(self, key: str, default: Any = None) -> Any:
        """Metadata value as plain Python (strings decoded, arrays as lists)."""
        field = self.reader.get_field(key)
        return default if field is None else _plain(field)

    def _require(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return value

    def _read_config(self) -> LlamaConfig:
        arch = self.metadata("general.architecture")
        if arch not in ROPE_MODE:
            raise GGUFError(f"{self.path}: unsupported architecture {arch!r} "
                            f"(supported: {', '.join(ROPE_MODE)})")
        k = lambda key: f"{arch}.{key}"  # noqa: E731
        n_embd = int(self._require(k("embedding_length")))
        n_head = int(self._require(k("attention.head_count")))
        head_dim = int(self.metadata(k("attention.key_length"), n_embd // n_head))
        if "token_embd.weight" not in self._tensors:
            raise GGUFError(f"{self.path}: missing required tensor 'token_embd.weight'")
        return LlamaConfig(
            arch=arch,
            n_layer=int(self._require(k("block_count"))),
            n_embd=n_embd,
            n_ff=int(self._require(k("feed_forward_length"))),
            n_head=n_head,
            n_head_kv=int(self.metadata(k("attention.head_count_kv"), n_head)),
            head_dim=head_dim,
            rope_base=float(self.metadata(k("rope.freq_base"), 10000.0)),
            rope_dims=int(self.metadata(k("rope.dimension_count"), head_dim)),
            rope_mode=ROPE_MODE[arch],
            rms_eps=float(self.metadata(k("attention.layer_norm_rms_epsilon"), 1e-5)),
            # The embedding's row count is what the weights actually hold.
            n_vocab=int(self._tensors["token_embd.weight"].shape[1]),
            n_ctx=int(self.metadata(k("context_length"), 2048)),
            tied_output="output.weight" not in self._tensors,
            qkv_bias="blk.0.attn_q.bias" in self._tensors,
        )

    # -- tensors ------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the config requires, with its numpy-order shape."""
        c = self.config
        q_out, kv_out = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        want = {"token_embd.weight": (c.n_vocab, c.n_embd), "output_norm.weight": (c.n_embd,)}
        if not c.tied_output:
            want["output.weight"] = (c.n_vocab, c.n_embd)
        for i in range(c.n_layer):
            b = f"blk.{i}."
            want.update({
                b + "attn_norm.weight": (c.n_embd,), b + "ffn_norm.weight": (c.n_embd,),
                b + "attn_q.weight": (q_out, c.n_embd), b + "attn_k.weight": (kv_out, c.n_embd),
                b + "attn_v.weight": (kv_out, c.n_embd), b + "attn_output.weight": (c.n_embd, q_out),
                b + "ffn_gate.weight": (c.n_ff, c.n_embd), b + "ffn_up.weight": (c.n_ff, c.n_embd),
                b + "ffn_down.weight": (c.n_embd, c.n_ff),
            })
            if c.qkv_bias:
                want.update({b + "attn_q.bias": (q_out,), b + "attn_k.bias": (kv_out,),
                             b + "attn_v.bias": (kv_out,)})
        return want

    def _validate(self) -> None:
        size = len(self.reader.data)
        for name, shape in self.expected_shapes().items():
            t = self._tensors.get(name)
            if t is None:
                raise GGUFError(f"{self.path}: missing required tensor {name!r}")
            got = tuple(int(d) for d in reversed(t.shape.tolist()))
            if got != shape:
                raise GGUFError(f"{self.path}: tensor {name!r} has shape {got}, expected {shape}")
            try:
                quant.qtype_name(t.tensor_type)
            except GGUFError as e:
                raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from None
            if t.data_offset + t.n_bytes > size:  # belt and braces; _Reader checks first
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file")

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> WeightTensor:
        """The named tensor; its ``raw`` bytes are a view into the mapped file."""
        t = self._tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: no tensor named {name!r}")
        try:
            qtype = quant.qtype_name(t.tensor_type)
        except GGUFError as e:
            raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from None
        raw = self.reader.mmap[t.data_offset:t.data_offset + t.n_bytes]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return WeightTensor(name=name, qtype=qtype, shape=shape, raw=raw)

    def __repr__(self) -> str:
        return f"GGUFModel({str(self.path)!r}, {self.config})"


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and validate a GGUF file (see GGUFModel)."""
    return GGUFModel(path)
