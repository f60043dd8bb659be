"""Open a decoder GGUF file (llama, qwen2, qwen3, gemma3): config from metadata, weights as mmap'd block bytes.

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
from toygraph.models.config import ModelConfig, check_tensors, read_config, tensor_shapes

# The config type; LlamaConfig is its earlier name, kept for callers.
LlamaConfig = ModelConfig


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
    """A decoder GGUF, validated at open: config, required tensors, types, bounds.

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
        self._shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist()))
                        for t in self.reader.tensors}
        self.config = read_config(self.metadata, list(self.reader.fields), self._shapes, self.path)
        self._validate()

    # -- metadata -----------------------------------------------------------------
    def metadata(self, key: str, default: Any = None) -> Any:
        """Metadata value as plain Python (strings decoded, arrays as lists)."""
        field = self.reader.get_field(key)
        return default if field is None else _plain(field)

    # -- tensors ------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the config requires, with its numpy-order shape."""
        return tensor_shapes(self.config)

    def _validate(self) -> None:
        """Every tensor the graph needs, with its shape and a readable block type, and no
        tensor it would ignore (models/config.check_tensors)."""
        size = len(self.reader.data)
        check_tensors(self.config, self._shapes, self.path)
        for name, t in self._tensors.items():
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
