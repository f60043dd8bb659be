"""The numpy kernels of the shape family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel


def _split_groups(x_shape, small_shape):
    """Reshape plan that turns a grouped reduction into plain sums.

    For each axis where x has s*g entries and the target has s (g > 1, s > 1), split it
    into (s, g). Returns the split shape and the axes to sum to reach the target shape.
    """
    n = len(x_shape)
    small = (1,) * (n - len(small_shape)) + tuple(small_shape)
    split, axes = [], []
    for xd, sd in zip(x_shape, small):
        if xd == sd:
            split.append(xd)
        elif sd == 1:
            axes.append(len(split))
            split.append(xd)
        else:
            split += [sd, xd // sd]
            axes.append(len(split) - 1)
    return split, tuple(axes)


@kernel("sum_to")
def _sum_to_numpy(out, srcs, attrs):
    x = srcs[0]
    split, axes = _split_groups(x.shape, out.shape)
    out[...] = x.reshape(split).sum(axis=axes).reshape(out.shape)


@kernel("expand")
def _expand_numpy(out, srcs, attrs):
    x = srcs[0]
    small = (1,) * (out.ndim - x.ndim) + x.shape
    y = x.reshape(small)
    for ax, (od, sd) in enumerate(zip(out.shape, small)):
        if od != sd and sd != 1:
            y = np.repeat(y, od // sd, axis=ax)
    out[...] = np.broadcast_to(y, out.shape)


@kernel("reshape")
def _reshape_numpy(out, srcs, attrs):
    if not np.may_share_memory(out, srcs[0]):   # else a view the buffer plan made
        out[...] = srcs[0].reshape(out.shape)


@kernel("permute")
def _permute_numpy(out, srcs, attrs):
    out[...] = np.transpose(srcs[0], attrs["axes"])


@kernel("contiguous")
def _contiguous_numpy(out, srcs, attrs):
    if not np.may_share_memory(out, srcs[0]):   # else a view the buffer plan made
        out[...] = srcs[0]


@kernel("sum")
def _sum_numpy(out, srcs, attrs):
    out[...] = np.sum(srcs[0], axis=attrs["axis"])


@kernel("unpack")
def _unpack_numpy(out, srcs, attrs):
    off = attrs["offset"]
    if np.may_share_memory(out, srcs[0]):  # a view the buffer plan made (core/buffer_plan.py)
        return
    out[...] = srcs[0].reshape(-1)[off:off + out.size].reshape(out.shape)
