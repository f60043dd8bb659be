"""Shape ops: reshape, permute, contiguous, the broadcasting pair expand / sum_to, the
reduction sum, and unpack (a view into a node that packs several results). Each op's
builder, shape rule, backward rule, numpy kernel and CUDA lowering (shape.cu: copies,
strided gathers, fixed-order sums; every walk packed into a ``Strided`` on the host).
"""
from __future__ import annotations

from math import prod

import numpy as np

from toygraph.core.ops.groups import PASS_THROUGH, VIEW
from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, contiguous_strides, declare_kernels, grid_1d, i32_arg,
                                    lowers, pad_shape, ptr_arg, rows_grid, strided)
from toygraph.errors import GraphError

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "shape.cu")


# --- broadcasting, including grouped-query sharing ---------------------------------------
def broadcast_shapes(a, b, allow_groups=False):
    """numpy broadcasting of two shapes; with ``allow_groups`` a dim of ``a`` that is a
    multiple of ``b``'s broadcasts too (grouped-query attention: query head h uses
    K/V head h // (Hq/Hkv)), and the result takes ``a``'s size."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif allow_groups and x % y == 0:
            out.append(x)
        else:
            raise GraphError(f"shapes {a} and {b} do not broadcast")
    return tuple(out)


def sum_to(x, shape):
    """Reduce ``x`` to ``shape``: sums broadcast dims and groups of a grouped dim."""
    if tuple(x.shape) == tuple(shape):
        return x
    return make_node("sum_to", [x], shape=tuple(shape))


def expand(x, shape):
    """Inverse of sum_to: broadcast ``x`` up to ``shape`` (repeating grouped dims)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return make_node("expand", [x], shape=tuple(shape))


def _infer_sum_to(shapes, dtypes, attrs):
    target = attrs["shape"]
    check(broadcast_shapes(shapes[0], target, allow_groups=True) == tuple(shapes[0]),
          f"cannot reduce {shapes[0]} to {target}")
    return target, dtypes[0]


def _infer_expand(shapes, dtypes, attrs):
    target = attrs["shape"]
    check(broadcast_shapes(target, shapes[0], allow_groups=True) == tuple(target),
          f"cannot expand {shapes[0]} to {target}")
    return target, dtypes[0]


define_op("sum_to", _infer_sum_to, lambda n, g, need: [expand(g, n.srcs[0].shape)])
define_op("expand", _infer_expand, lambda n, g, need: [sum_to(g, n.srcs[0].shape)])


# --- reshape, permute, contiguous ------------------------------------------------------------
def reshape(x, shape):
    shape = tuple(int(s) for s in shape)
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        check(known > 0 and x.size % known == 0, f"reshape {x.shape} -> {shape}: sizes differ")
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    return make_node("reshape", [x], shape=shape)


def _infer_reshape(shapes, dtypes, attrs):
    check(int(np.prod(shapes[0])) == int(np.prod(attrs["shape"])),
          f"cannot reshape {shapes[0]} to {attrs['shape']}")
    return attrs["shape"], dtypes[0]


define_op("reshape", _infer_reshape, lambda n, g, need: [reshape(g, n.srcs[0].shape)],
          groups={VIEW, PASS_THROUGH})


def permute(x, axes):
    axes = tuple(a % x.ndim for a in axes) if x.ndim else tuple(axes)
    return make_node("permute", [x], axes=axes)


def _infer_permute(shapes, dtypes, attrs):
    axes = attrs["axes"]
    check(sorted(axes) == list(range(len(shapes[0]))),
          f"axes {axes} are not a permutation of {len(shapes[0])} axes")
    return tuple(shapes[0][i] for i in axes), dtypes[0]


define_op("permute", _infer_permute,
    lambda n, g, need: [permute(g, tuple(np.argsort(n.attrs["axes"])))], groups={PASS_THROUGH})


def contiguous(x):
    """A copy in row-major layout (numpy's arrays always are; CUDA may need the copy)."""
    return make_node("contiguous", [x])


define_op("contiguous", lambda s, d, a: (s[0], d[0]), lambda n, g, need: [g],
          groups={VIEW, PASS_THROUGH})


# --- sum ---------------------------------------------------------------------------------------
def sum(x, axis=None):  # noqa: A001 - mirrors numpy's name on purpose
    return make_node("sum", [x], axis=None if axis is None else int(axis) % x.ndim)


def _infer_sum(shapes, dtypes, attrs):
    check_floats(dtypes)
    ax = attrs["axis"]
    return (() if ax is None else tuple(s for i, s in enumerate(shapes[0]) if i != ax)), F32


def _grad_sum(n, g, need):
    x, ax = n.srcs[0], n.attrs["axis"]
    keep = tuple(1 if ax is None or i == ax else s for i, s in enumerate(x.shape))
    return [expand(reshape(g, keep), x.shape)]


define_op("sum", _infer_sum, _grad_sum)


# --- unpack ------------------------------------------------------------------------------------
def unpack(x, offset: int, shape):
    """Elements [offset, offset + prod(shape)) of x (read flat) as a tensor of ``shape``:
    how one node that packs several results (attention_back) hands them out."""
    return make_node("unpack", [x], offset=int(offset), shape=tuple(int(s) for s in shape))


def _infer_unpack(shapes, dtypes, attrs):
    off, shape = attrs["offset"], attrs["shape"]
    size = int(np.prod(shapes[0]))
    check(all(s > 0 for s in shape), f"unpack shape must be positive, got {shape}")
    check(0 <= off and off + int(np.prod(shape)) <= size,
          f"unpack [{off}, {off + int(np.prod(shape))}) lies outside {size} elements")
    return shape, dtypes[0]


define_op("unpack", _infer_unpack, groups={VIEW})


# --- numpy kernels -----------------------------------------------------------------------------
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


# --- CUDA lowering (shape.cu) ------------------------------------------------------------------
def expand_walk(src_shape, out_shape):
    """(dims, src strides) that walk ``out_shape`` reading the broadcast/repeated source."""
    src = pad_shape(src_shape, len(out_shape))
    cs = contiguous_strides(src)
    dims, sa = [], []
    for s, o, c in zip(src, out_shape, cs):
        if s == o:
            dims.append(o), sa.append(c)
        elif s == 1:
            dims.append(o), sa.append(0)
        else:  # grouped: np.repeat of each entry o // s times
            dims += [s, o // s]
            sa += [c, 0]
    return dims, sa


def sum_to_walk(x_shape, target):
    """(kept dims, kept strides, reduced dims, reduced strides) reducing x to ``target``."""
    small = pad_shape(target, len(x_shape))
    cs = contiguous_strides(x_shape)
    kd, ks, rd, rs = [], [], [], []
    for xd, sd, c in zip(x_shape, small, cs):
        if xd == sd:
            kd.append(xd), ks.append(c)
        elif sd == 1:
            rd.append(xd), rs.append(c)
        else:  # grouped: x's entry i belongs to target entry i // g
            g = xd // sd
            kd.append(sd), ks.append(c * g)
            rd.append(g), rs.append(c)
    return kd, ks, rd, rs


@lowers("reshape", "contiguous", kernels=("tg_copy",))
def _copy(node, at):
    """A copy; nothing when the buffer plan made the node a view of its source."""
    n = node.size
    if at.out == at.ptr(node.srcs[0]):
        return []
    return [Launch("tg_copy", grid_1d(n), [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])),
                                           i32_arg(n)])]


@lowers("unpack", kernels=("tg_copy",))
def _unpack(node, at):
    """A copy out of the packed buffer, read from the element offset on; nothing when the
    buffer plan made the unpack a view of those very bytes (core/buffer_plan.py)."""
    n = node.size
    src = at.ptr(node.srcs[0]) + (2 if at.half(node.srcs[0]) else 4) * node.attrs["offset"]
    if src == at.out:
        return []
    return [Launch("tg_copy", grid_1d(n), [ptr_arg(at.out), ptr_arg(src), i32_arg(n)])]


def _gather(node, at, dims, sa):
    n = node.size
    return [Launch("tg_gather", grid_1d(n),
                   [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])), i32_arg(n),
                    strided(dims, sa)])]


@lowers("permute", kernels=("tg_gather",))
def _permute(node, at):
    cs = contiguous_strides(node.srcs[0].shape)
    return _gather(node, at, node.shape, [cs[ax] for ax in node.attrs["axes"]])


@lowers("expand", kernels=("tg_gather",))
def _expand(node, at):
    return _gather(node, at, *expand_walk(node.srcs[0].shape, node.shape))


def _reduce(out_ptr, x_ptr, kd, ks, rd, rs) -> Launch:
    """A thread per output for short reductions over many outputs, else a block per output."""
    n_out, n_red = prod(kd), prod(rd)
    args = [ptr_arg(out_ptr), ptr_arg(x_ptr), i32_arg(n_out), strided(kd, ks), strided(rd, rs),
            i32_arg(n_red)]
    if n_red <= 64 and n_out > 1:
        return Launch("tg_reduce_thread", grid_1d(n_out), args)
    return Launch("tg_reduce_block", rows_grid(n_out), args)


@lowers("sum_to", kernels=("tg_reduce_block", "tg_reduce_thread"))
def _sum_to(node, at):
    x = node.srcs[0]
    return [_reduce(at.out, at.ptr(x), *sum_to_walk(x.shape, node.shape))]


@lowers("sum", kernels=("tg_reduce_block", "tg_reduce_thread"))
def _sum(node, at):
    x, ax = node.srcs[0], node.attrs["axis"]
    cs = contiguous_strides(x.shape)
    if ax is None:
        return [_reduce(at.out, at.ptr(x), [], [], list(x.shape), cs)]
    kd = [d for i, d in enumerate(x.shape) if i != ax]
    ks = [c for i, c in enumerate(cs) if i != ax]
    return [_reduce(at.out, at.ptr(x), kd, ks, [x.shape[ax]], [cs[ax]])]
