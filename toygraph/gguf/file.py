"""A GGUF file opened for reading: metadata and tensors, as memory-mapped block bytes.

The file is parsed by the bounded reader (reader.py), which memory-maps it: opening reads
the header, metadata and tensor index, and no weight byte is read until a tensor is
decoded (or bound to a device buffer). What the tensors mean is the model layer's business
(toygraph.models.model reads a file as a decoder).

>>> f = GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf")          # doctest: +SKIP
>>> f.metadata("general.architecture"), f.tensor("token_embd.weight").qtype  # doctest: +SKIP
('llama', 'q4_1')
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toygraph.errors import GGUFError
from toygraph.gguf import blocks
# The bounded parser of header, metadata and tensor index (see reader.py).
from toygraph.gguf.reader import BoundedReader as _Reader
from toygraph.gguf.reader import PastEnd as _PastEnd


@dataclass
class WeightTensor:
    """One GGUF tensor: its block-format bytes (a memmap view) and numpy-order shape."""
    name: str
    qtype: str
    shape: tuple[int, ...]
    raw: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 of ``shape`` (reads the mapped bytes)."""
        return blocks.dequantize(self.raw, self.qtype, self.shape)


def _plain(field) -> Any:
    """A ReaderField's value as plain Python (str, int, float, bool, or list)."""
    v = field.contents()
    if isinstance(v, np.generic):
        return v.item()
    return v


class GGUFFile:
    """A GGUF file, checked at open: a readable header and index, every tensor inside the
    file and in a block format toygraph decodes."""

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
        self._check_blocks()

    # -- metadata -----------------------------------------------------------------
    def metadata(self, key: str, default: Any = None) -> Any:
        """Metadata value as plain Python (strings decoded, arrays as lists)."""
        field = self.reader.get_field(key)
        return default if field is None else _plain(field)

    # -- tensors ------------------------------------------------------------------
    def _check_blocks(self) -> None:
        """Every tensor in a block format we decode, and inside the file."""
        size = len(self.reader.data)
        for name, t in self._tensors.items():
            try:
                blocks.qtype_name(t.tensor_type)
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
        qtype = blocks.qtype_name(t.tensor_type)   # checked at open
        raw = self.reader.mmap[t.data_offset:t.data_offset + t.n_bytes]
        return WeightTensor(name=name, qtype=qtype, shape=self._shapes[name], raw=raw)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r})"
