"""Decode block-format tensors into buffers the caller owns, fast: the numpy backend's
just-in-time decoding of a frozen base kept in its GGUF format (core/base_memory.py).

:func:`dequantize_into` gives exactly ``blocks.dequantize``'s values (the same f32 products
in the same order) but writes into ``out`` and runs decode.cpp, built once with the host
compiler (toygraph/native.py) and run on every CPU this process may use; without a
compiler, or if the build fails, it says so once on this module's logger and falls back to
blocks.dequantize (about 1.3 ns an element for q8_0, 12 for q4_k, 21 for q6_k on one
core: usable, several times slower).

:class:`BlockTensor` is one frozen tensor as its block bytes (an mmap'd GGUF slice), with
``decode_into`` for the whole of it, ``decode_rows`` for the rows an embedding lookup
needs and ``part`` for one expert of a stacked [E, out, in] tensor.

>>> t = BlockTensor(raw, "q4_k", (2048, 8192))                     # doctest: +SKIP
>>> t.decode_into(scratch)                                        # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from toygraph import environment, native
from toygraph.errors import GGUFError, ToygraphError
from toygraph.gguf import blocks

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")
#: The formats decode.cpp knows, in the order of its kFormats table.
FORMATS = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k",
           "q4_k", "q5_k", "q6_k", "iq4_xs")
#: -ffp-contract=off and no fast-math keep blocks.py's f32 rounding order bit for bit;
#: -march=native is safe for the values (IEEE ops whatever the vector width), and the
#: CPU's flags are part of the cache key so a shared cache never hands a library to a
#: CPU it was not built for.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread",
         "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden")
#: Fewer elements than this decode on one thread (starting threads costs ~50 us).
_THREADED_ELEMENTS = 1 << 16


def threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@lru_cache(maxsize=None)
def library():
    """decode.cpp as a loaded library, or None (no compiler, or the build failed: logged
    once)."""
    source = f"// cpu {_cpu_flags()}\n{blocks.c_defines()}{SOURCE.read_text()}"
    try:
        path, _ = native.build_shared(source, FLAGS, environment.cache_dir("kernels") / "decode",
                                      "the block decoders (toygraph/gguf/decode.cpp)")
        lib = ctypes.CDLL(str(path))
    except (ToygraphError, OSError) as e:
        logger.warning("block decoding falls back to numpy (several times slower): %s",
                       str(e).splitlines()[0])
        return None
    lib.tg_decode_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int]
    lib.tg_decode_blocks.restype = ctypes.c_int
    return lib


def dequantize_into(raw, qtype: str, shape, out: np.ndarray, *, native_code: bool = True
                    ) -> np.ndarray:
    """Decode ``raw`` block bytes of a ``qtype`` tensor of ``shape`` into ``out`` (a float
    array of that shape) and return it; the values are ``blocks.dequantize``'s, bit for
    bit. ``native_code=False`` takes the numpy path."""
    shape = tuple(int(s) for s in shape)
    if out.shape != shape:
        raise GGUFError(f"decode {qtype}: out has shape {out.shape}, want {shape}")
    data = np.asarray(raw)
    lib = library() if native_code and qtype in FORMATS else None
    if lib is None or out.dtype != np.float32 or not out.flags.c_contiguous:
        np.copyto(out, blocks.dequantize(data, qtype, shape), casting="unsafe")
        return out
    elems, size = blocks.block_shape(qtype, shape)
    data = blocks.as_bytes(data)
    if data.size != blocks.nbytes(qtype, shape):
        raise GGUFError(f"{qtype} tensor of shape {shape} needs {blocks.nbytes(qtype, shape)} "
                        f"bytes, got {data.size}")
    n = data.size // size
    lib.tg_decode_blocks(FORMATS.index(qtype), data.ctypes.data, out.ctypes.data, n,
                         threads() if out.size >= _THREADED_ELEMENTS else 1)
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

    def __init__(self, data, storage: str, shape):
        self.storage, self.shape = storage, tuple(int(s) for s in shape)
        self.data = blocks.as_bytes(data)
        self._sparse = False   # advised MADV_RANDOM already (read_sparsely)
        self.nbytes = blocks.nbytes(storage, self.shape)
        if self.data.size != self.nbytes:
            raise GGUFError(f"{storage} tensor of shape {self.shape} needs {self.nbytes} bytes, "
                            f"got {self.data.size}")

    def decode_into(self, out: np.ndarray) -> np.ndarray:
        """The whole tensor, decoded into ``out`` (its shape, any float dtype)."""
        return dequantize_into(self.data, self.storage, self.shape, out)

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
        table = self.data.reshape(rows, -1)
        return dequantize_into(np.take(table, ids.reshape(-1), axis=0), self.storage,
                               (ids.size, cols), out.reshape(ids.size, cols))

    def __array__(self, dtype=None, copy=None):
        """The whole tensor as a new f32 array (downloads; not for the step's hot path)."""
        arr = blocks.dequantize(self.data, self.storage, self.shape)
        return arr if dtype is None else arr.astype(dtype)
