"""The CUDA lowering of the shape family (kernels in shape.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from math import prod

from toygraph.ops.lowering import (Launch, contiguous_strides, declare_kernels, grid_1d, i32_arg,
                                   lowers, pad_shape, ptr_arg, rows_grid, strided)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "shape.cu")


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
