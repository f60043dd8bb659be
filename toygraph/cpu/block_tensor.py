"""A frozen tensor kept as its GGUF block bytes, decoded or multiplied by the CPU engine.

:func:`dequantize_into` gives exactly ``blocks.dequantize``'s values (the same f32 products
in the same order) but writes into a buffer the caller owns, on the engine's threads; without
the engine (no compiler) it falls back to blocks.dequantize (several times slower).

:class:`BlockTensor` is one frozen tensor as its block bytes (an mmap'd GGUF slice): the
whole of it (``decode_into``), the rows an embedding lookup needs (``decode_rows``), one
expert of a stacked [E, out, in] tensor (``part``), and the products of a 2-D weight
computed on the blocks without an f32 copy (``matmul_nt``: x W^T, ``matmul_nn``: g W).

>>> t = BlockTensor(raw, "q4_k", (2048, 8192))                     # doctest: +SKIP
>>> t.matmul_nt(x, out)                                           # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from toygraph.cpu import engine
from toygraph.errors import GGUFError
from toygraph.gguf import blocks


def dequantize_into(raw, qtype: str, shape, out: np.ndarray, *, native_code: bool = True
                    ) -> np.ndarray:
    """Decode ``raw`` block bytes of a ``qtype`` tensor of ``shape`` into ``out`` (a float
    array of that shape) and return it; the values are ``blocks.dequantize``'s, bit for
    bit. ``native_code=False`` takes the numpy path."""
    shape = tuple(int(s) for s in shape)
    if out.shape != shape:
        raise GGUFError(f"decode {qtype}: out has shape {out.shape}, want {shape}")
    data = np.asarray(raw)
    if not (native_code and engine.available(qtype)) or out.dtype != np.float32 \
            or not out.flags.c_contiguous:
        np.copyto(out, blocks.dequantize(data, qtype, shape), casting="unsafe")
        return out
    blocks.block_shape(qtype, shape)
    data = blocks.as_bytes(data)
    if data.size != blocks.nbytes(qtype, shape):
        raise GGUFError(f"{qtype} tensor of shape {shape} needs {blocks.nbytes(qtype, shape)} "
                        f"bytes, got {data.size}")
    engine.decode(data, qtype, out.size, out)
    return out


def _libc_madvise():
    if not hasattr(mmap, "MADV_WILLNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise()


class BlockTensor:
    """A frozen tensor kept as its block bytes: ``data`` (uint8, may be an mmap'd GGUF
    slice), its format ``storage`` and its logical ``shape`` (rows along the last axis)."""

    #: Rows of x up to which ``matmul_few_rows`` applies (the engine's dot kernels').
    FEW_ROWS = engine.DOT_MAX_M

    def __init__(self, data, storage: str, shape):
        self.storage, self.shape = storage, tuple(int(s) for s in shape)
        self.data = blocks.as_bytes(data)
        self._sparse = False   # advised MADV_RANDOM already (read_sparsely)
        self._engine_weight = None
        self._few = None       # matmul_few_rows' last operands and their row views
        self.nbytes = blocks.nbytes(storage, self.shape)
        if self.data.size != self.nbytes:
            raise GGUFError(f"{storage} tensor of shape {self.shape} needs {self.nbytes} bytes, "
                            f"got {self.data.size}")

    def decode_into(self, out: np.ndarray) -> np.ndarray:
        """The whole tensor, decoded into ``out`` (its shape, any float dtype)."""
        return dequantize_into(self.data, self.storage, self.shape, out)

    @property
    def computes_on_blocks(self) -> bool:
        """Whether the engine multiplies this tensor without decoding it whole (a 2-D weight
        in a format the engine knows, the engine built)."""
        return len(self.shape) == 2 and engine.available(self.storage)

    def matmul_nt(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` [M, N] = x [M, K] . W^T, this tensor W [N, K] read in its blocks."""
        return self.weight().matmul(x, out, transposed=True)

    def matmul_few_rows(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` [..., N] = x [..., K] . W^T for C-contiguous x and out of at most
        engine.DOT_MAX_M rows (generation's step): the row views and their addresses of the
        last (x, out) pair are reused, as generation passes the same buffers every token.
        (Few rows only: the views keep x and out alive as long as this tensor.)"""
        c = self._few
        if c is None or c[0] is not x or c[1] is not out:
            c = self._few = (x, out, x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1]))
        self.weight().matmul_again(c[2], c[3])
        return out

    def matmul_nn(self, g: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` [M, K] = g [M, N] . W, this tensor W [N, K] read in its blocks."""
        return self.weight().matmul(g, out, transposed=False)

    def weight(self) -> "engine.Weight":
        """The engine's handle on these bytes (checked once, then reused every step)."""
        if self._engine_weight is None:
            self._engine_weight = engine.Weight(self.data, self.storage, self.shape)
        return self._engine_weight

    def part(self, i: int) -> "BlockTensor":
        """Slice ``i`` along the first axis (one expert of [E, out, in]) as a BlockTensor
        over the same bytes: nothing is read or copied until it is decoded."""
        per = self.nbytes // self.shape[0]
        return BlockTensor(self.data[i * per:(i + 1) * per], self.storage, self.shape[1:])

    def read_sparsely(self) -> None:
        """Tell the kernel these bytes are read in scattered pieces (a MoE's stacked
        experts, of which a step reads the chosen few): madvise(MADV_RANDOM), so a page
        fault reads its page, not the disk's read-ahead window (megabytes: the unused
        experts around it). Advised once per tensor, and only by the kernel that reads it
        piecewise: a whole-tensor decode or a device upload keeps the read-ahead. Pair it
        with ``prefetch`` of the pieces (without, cold reads go page by page). Best effort."""
        if self._sparse or _madvise is None or self.data.size == 0:
            return
        self._sparse = True
        self._advise(mmap.MADV_RANDOM)

    def _advise(self, advice: int) -> None:
        start = self.data.ctypes.data
        aligned = start - start % mmap.PAGESIZE
        _madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(start + self.data.size - aligned),
                 advice)

    def prefetch(self) -> None:
        """Ask the kernel to start reading these bytes now (madvise MADV_WILLNEED over
        their pages): one large asynchronous read of a mapped expert's slice instead of a
        page fault per 4 KiB (the expert tensors are advised MADV_RANDOM: ``read_sparsely``).
        Best effort: nothing happens where madvise is missing or refuses."""
        if _madvise is None or self.data.size == 0:
            return
        self._advise(mmap.MADV_WILLNEED)

    def decode_rows(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of a 2-D tensor decoded into ``out`` [len(ids), cols]: only their
        blocks are read, and each row's values are those of the whole decoded tensor."""
        rows, cols = self.shape
        flat = out.reshape(ids.size, cols)
        if engine.available(self.storage) and out.dtype == np.float32 and out.flags.c_contiguous:
            engine.decode_rows(self.data, self.storage, self.shape, ids.reshape(-1), flat)
            return out
        table = self.data.reshape(rows, -1)
        dequantize_into(np.take(table, ids.reshape(-1), axis=0), self.storage, (ids.size, cols),
                        flat)
        return out

    def __array__(self, dtype=None, copy=None):
        """The whole tensor as a new f32 array (downloads; not for the step's hot path)."""
        arr = blocks.dequantize(self.data, self.storage, self.shape)
        return arr if dtype is None else arr.astype(dtype)
