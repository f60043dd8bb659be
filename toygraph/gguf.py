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
import gguf as _gguf

from toygraph import quant
from toygraph.errors import GGUFError
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


class _Reader(_gguf.GGUFReader):
    """GGUFReader, leaner on metadata, and naming the tensor whose data runs past EOF.

    The stock reader slices its ``np.memmap`` once per metadata value: for a 49k-token
    vocabulary that is ~250k memmap views, each dragging a Python attribute dict and a
    fresh byte-order dtype (~160 MB resident for SmolLM2, 2.5 s). Parsing from a plain
    ndarray view of the same mapping, and skipping the no-op byte-order view, gives the
    same values in ~40 MB and 0.5 s. ``mmap`` keeps the original memmap for tensor data.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mm: np.memmap) -> None:  # GGUFReader.__init__ assigns the memmap here
        self.mmap = mm
        self._plain_data = mm.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):
        order = self.byte_order if override_order is None else override_order
        if order == "S":  # byte-swapped file: let the stock reader handle it
            return super()._get(offset, dtype, count, override_order)
        dt = np.dtype(dtype)
        return self._plain_data[offset:offset + dt.itemsize * int(count)].view(dt)

    # The stock reader fails with a bare numpy reshape error when a tensor's data runs
    # past the end of the file; check the bounds first, from the parsed tensor index.
    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                qt = _gguf.GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise GGUFError(f"tensor {name!r} has unknown ggml type id {int(raw_type[0])}") from None
            block, type_size = _gguf.GGML_QUANT_SIZES[qt]
            end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise _PastEnd(f"tensor {name!r} data ends at byte {end}, past the end of the file ({size} bytes)")
        super()._build_tensors(start_offs, fields)


class _PastEnd(GGUFError):
    pass


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
