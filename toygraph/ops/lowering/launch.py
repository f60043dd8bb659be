"""Kernel launches and their fixed-width arguments, shared by every lowering module."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toygraph.ops.lowering.constants import MAXD, THREADS
from toygraph.errors import CudaError

MAX_GRID = 1 << 20  # grid-stride loops cover the rest
MAX_GRID_YZ = 65535
INT32_MAX = 2 ** 31 - 1
# Grid-stride loops index with int: i + gridDim*blockDim must not overflow past the end.
MAX_ELEMENTS = INT32_MAX - MAX_GRID * THREADS


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    args: list = field(default_factory=list)   # numpy arrays, one per kernel parameter
    block: tuple[int, int, int] = (THREADS, 1, 1)
    shmem: int = 0


@dataclass(frozen=True)
class Collective:
    """A step of a node's launch sequence that is no kernel: an in-place sum over ``ranks``
    ranks of f32 device buffers ``(address, count)``, which the context enqueues on the
    stream (NCCL on a GPU, MPI on the host device; ops/collective/'s all_reduce)."""
    buffers: tuple[tuple[int, int], ...]
    ranks: int
    what: str = "the all-reduce of the step's gradients"


# --- argument packing ----------------------------------------------------------------------
def ptr_arg(addr: int) -> np.ndarray:
    return np.array([addr], np.uint64)


def i32_arg(v: int) -> np.ndarray:
    v = int(v)
    if not -2 ** 31 <= v <= INT32_MAX:
        raise CudaError(f"kernel argument {v} does not fit in int32")
    return np.array([v], np.int32)


def f32_arg(v: float) -> np.ndarray:
    return np.array([v], np.float32)


def f64_arg(v: float) -> np.ndarray:
    return np.array([v], np.float64)


def contiguous_strides(shape) -> list[int]:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= int(s)
    return out[::-1]


def collapse(dims, *strides):
    """Drop size-1 dims and merge neighbours that walk memory as one dim in every operand."""
    keep = [i for i, d in enumerate(dims) if d != 1]
    dims = [int(dims[i]) for i in keep]
    strides = [[int(s[i]) for i in keep] for s in strides]
    i = len(dims) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * dims[i + 1] for s in strides):
            dims[i] *= dims[i + 1]
            for s in strides:
                s[i] = s[i + 1]
                del s[i + 1]
            del dims[i + 1]
        i -= 1
    return dims, strides


def strided(dims, sa, sb=None) -> np.ndarray:
    """Pack a ``Strided`` struct (int nd; int dims[8], sa[8], sb[8]) as 25 int32s."""
    sb = [0] * len(dims) if sb is None else sb
    dims, (sa, sb) = collapse(dims, sa, sb)
    if len(dims) > MAXD:
        raise CudaError(f"a strided walk over {len(dims)} dims exceeds the kernels' {MAXD}")
    buf = np.zeros(1 + 3 * MAXD, np.int32)
    buf[0] = len(dims)
    for k, vals in enumerate((dims, sa, sb)):
        buf[1 + k * MAXD:1 + k * MAXD + len(vals)] = vals
    return buf


# --- grids -----------------------------------------------------------------------------------
def grid_1d(n: int) -> tuple[int, int, int]:
    """Blocks of THREADS threads covering ``n`` elements (grid-stride loops cover the rest
    beyond MAX_GRID blocks)."""
    return (max(1, min((int(n) + THREADS - 1) // THREADS, MAX_GRID)), 1, 1)


def rows_grid(rows: int) -> tuple[int, int, int]:
    """One block per row of a row-wise kernel (grid-stride beyond MAX_GRID rows)."""
    return (max(1, min(int(rows), MAX_GRID)), 1, 1)


def pad_shape(shape, n):
    """``shape`` with leading 1s up to ``n`` dims (broadcasting's alignment)."""
    return (1,) * (n - len(shape)) + tuple(shape)


def last_axis_rows(node) -> tuple[int, int]:
    """(rows, row length) of a row-wise op over the last axis."""
    D = node.shape[-1] if node.shape else 1
    return node.size // D, D
