"""CUDA lowering of the ops that move or reduce elements without arithmetic on them
(elementwise.cu's copy/gather, the reductions): reshape, contiguous, unpack, permute,
expand, sum_to and sum. Every walk is packed into a ``Strided`` on the host."""
from __future__ import annotations

from math import prod

from .launch import Launch, _blocks, _pad, _rows_grid, contiguous_strides, i32, p, strided
from .registry import lowers


def expand_walk(src_shape, out_shape):
    """(dims, src strides) that walk ``out_shape`` reading the broadcast/repeated source."""
    src = _pad(src_shape, len(out_shape))
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
    small = _pad(target, len(x_shape))
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
    n = node.size
    return [Launch("tg_copy", _blocks(n), [p(at.out), p(at.ptr(node.srcs[0])), i32(n)])]


@lowers("unpack", kernels=("tg_copy",))
def _unpack(node, at):
    """A copy out of the packed buffer, read from the element offset on."""
    n = node.size
    src = at.ptr(node.srcs[0]) + 4 * node.attrs["offset"]
    return [Launch("tg_copy", _blocks(n), [p(at.out), p(src), i32(n)])]


def _gather(node, at, dims, sa):
    n = node.size
    return [Launch("tg_gather", _blocks(n),
                   [p(at.out), p(at.ptr(node.srcs[0])), i32(n), strided(dims, sa)])]


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
    args = [p(out_ptr), p(x_ptr), i32(n_out), strided(kd, ks), strided(rd, rs), i32(n_red)]
    if n_red <= 64 and n_out > 1:
        return Launch("tg_reduce_thread", _blocks(n_out), args)
    return Launch("tg_reduce_block", _rows_grid(n_out), args)


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
