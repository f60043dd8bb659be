"""The shape family's engine replay (cpu.h beside this): permute, expand, and reshape,
contiguous and unpack where the plan did not make them views, as one strided copy
(``copy``); sum_to and sum as one fixed-order reduction (``reduce``).

:func:`walk` is how every strided kernel (these, the elementwise family's broadcasts, the
slicing family's narrow) is told its layout: the elementwise family's cpu.h reads it.
"""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.shape.numpy import _split_groups

#: The axes a walk holds (elementwise/cpu.h's kWalkDims).
WALK_DIMS = 6


def row_major(shape) -> list[int]:
    """The element strides of a contiguous array of ``shape``."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return strides[::-1]


def broadcast_strides(shape, out_shape):
    """The element strides at which a contiguous operand of ``shape`` is read for each axis
    of ``out_shape`` under numpy broadcasting (0 on an axis it is broadcast over), or None
    where it does not broadcast so."""
    if len(shape) > len(out_shape):
        return None
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    if any(s not in (1, o) for s, o in zip(padded, out_shape)):
        return None
    return [0 if s == 1 and o != 1 else st
            for s, o, st in zip(padded, out_shape, row_major(padded))]


def merged(shape, *strides):
    """(sizes, [strides per operand]) with size-1 axes dropped and each axis merged into the
    one before it where every operand steps through the two as through one: the fewest
    axes that walk the same elements in the same order."""
    sizes, steps = [], [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if sizes and all(st[-1] == s[d] * size for st, s in zip(steps, strides)):
            sizes[-1] *= size
            for st, s in zip(steps, strides):
                st[-1] = s[d]
            continue
        sizes.append(size)
        for st, s in zip(steps, strides):
            st.append(s[d])
    if not sizes:   # one element
        return [1], [[0] for _ in strides]
    return sizes, steps


def walk(shape, *strides):
    """The walk over a contiguous output of ``shape`` reading operands at element
    ``strides`` (one list per operand) as the kernels read it: int64 [axes, sizes[6],
    each operand's strides[6]] after :func:`merged`; None past six axes."""
    sizes, steps = merged(shape, *strides)
    if len(sizes) > WALK_DIMS:
        return None
    pad = lambda v: list(v) + [0] * (WALK_DIMS - len(v))   # noqa: E731
    return np.array([len(sizes), *pad(sizes), *(x for st in steps for x in pad(st))], np.int64)


def _copyable(out, x) -> bool:
    """A copy of 4-byte elements (f32, or i32 ids and labels passing through) between
    contiguous arrays of one dtype."""
    return (isinstance(out, np.ndarray) and isinstance(x, np.ndarray) and out.dtype == x.dtype
            and out.dtype.itemsize == 4 and out.flags.c_contiguous and x.flags.c_contiguous)


def copy_call(out, x, strides, offset: int = 0):
    """out = the elements of ``x`` from ``offset`` on at ``strides`` (one per axis of
    out), or None past six axes."""
    wk = walk(out.shape, strides)
    if wk is not None:
        return Call("copy", [out, x.ctypes.data + 4 * offset, wk], [out.size], keep=[wk])


@replays("permute")
def _permute(node, out, srcs, attrs):
    x = srcs[0]
    if _copyable(out, x):
        xs = row_major(x.shape)
        return copy_call(out, x, [xs[a] for a in attrs["axes"]])


@replays("expand")
def _expand(node, out, srcs, attrs):
    """Broadcast axes read at stride 0; a grouped axis (s -> s g) as the pair (s, g), the
    second at stride 0: each element repeated g times in a row, as np.repeat."""
    x = srcs[0]
    if not _copyable(out, x) or x.ndim > out.ndim:
        return None
    small = (1,) * (out.ndim - x.ndim) + x.shape
    shape, strides = [], []
    for od, sd, st in zip(out.shape, small, row_major(small)):
        if od == sd:
            shape.append(od), strides.append(st)
        elif sd == 1:
            shape.append(od), strides.append(0)
        else:
            shape += [sd, od // sd]
            strides += [st, 0]
    wk = walk(shape, strides)
    if wk is not None:
        return Call("copy", [out, x, wk], [out.size], keep=[wk])


def _flat_copy(offset_of):
    def call(node, out, srcs, attrs):
        x = srcs[0]
        if _copyable(out, x) and not np.may_share_memory(out, x):   # else a view: nothing to do
            return copy_call(out, x, row_major(out.shape), offset_of(attrs))
    return call


replays("reshape")(_flat_copy(lambda attrs: 0))
replays("contiguous")(_flat_copy(lambda attrs: 0))
replays("unpack")(_flat_copy(lambda attrs: attrs["offset"]))


# --- reductions ----------------------------------------------------------------------------------
def reduce_call(out, x, shape, axes):
    """out = the sum of ``x`` (contiguous, read as ``shape``) over ``axes``, the kept axes
    in order being out's: the kernel's layout [kept walk (1 operand), summed walk]."""
    strides = row_major(shape)
    kept = walk([s for d, s in enumerate(shape) if d not in axes],
                [st for d, st in enumerate(strides) if d not in axes])
    summed = walk([shape[d] for d in axes], [strides[d] for d in axes])
    if kept is None or summed is None:
        return None
    layout = np.concatenate([kept, summed])
    return Call("reduce", [out, x, layout], [out.size], keep=[layout])


@replays("sum_to")
def _sum_to(node, out, srcs, attrs):
    x = srcs[0]
    if f32_contiguous(out, x):
        split, axes = _split_groups(x.shape, out.shape)
        return reduce_call(out, x, split, axes)


@replays("sum")
def _sum(node, out, srcs, attrs):
    x, axis = srcs[0], attrs["axis"]
    if f32_contiguous(out, x):
        return reduce_call(out, x, x.shape, tuple(range(x.ndim)) if axis is None else (axis,))
