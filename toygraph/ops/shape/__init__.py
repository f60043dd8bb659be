"""Shape ops: reshape, permute, contiguous, the broadcasting pair expand / sum_to, the
reduction sum, and unpack (a view into a node that packs several results). Each op's
builder, shape rule, backward rule, numpy kernel and CUDA lowering (shape.cu: copies,
strided gathers, fixed-order sums; every walk packed into a ``Strided`` on the host).
"""
from __future__ import annotations

import numpy as np

from toygraph.errors import GraphError
from toygraph.ops.groups import PASS_THROUGH, VIEW
from toygraph.ops.table import F32, check, check_floats, define_op, make_node


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
