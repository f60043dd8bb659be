"""narrow: a slice of the last axis, x[..., start:start + length], and its backward (the
gradient placed back in zeros). Qwen3.5 splits its fused projections with it (the gated
query's [q | gate] per head, the DeltaNet's conv output [q | k | v]). Builder, shape rule,
backward rule, numpy kernels and CUDA lowering (slicing.cu)."""
from __future__ import annotations

from toygraph.core.ops.table import F32, check, define_op, kernel, make_node
from toygraph.cuda.lowering import Launch, declare_kernels, grid_1d, i32_arg, lowers, ptr_arg

declare_kernels(__file__, "slicing.cu")


def narrow(x, start: int, length: int):
    """x[..., start:start + length] (a copy)."""
    return make_node("narrow", [x], start=int(start), length=int(length))


def _infer_narrow(shapes, dtypes, attrs):
    (xs,), start, length = shapes, attrs["start"], attrs["length"]
    check(dtypes[0] == F32, f"narrow needs f32, got {dtypes[0]}")
    check(length >= 1 and 0 <= start and start + length <= xs[-1],
          f"narrow [{start}, {start + length}) must lie inside the last axis of {list(xs)}")
    return tuple(xs[:-1]) + (length,), F32


def _infer_narrow_back(shapes, dtypes, attrs):
    return tuple(shapes[0][:-1]) + (attrs["width"],), F32


define_op("narrow", _infer_narrow, lambda n, g, need: [make_node(
    "narrow_back", [g], start=n.attrs["start"], width=n.srcs[0].shape[-1])])
define_op("narrow_back", _infer_narrow_back)


@kernel("narrow")
def _narrow_numpy(out, srcs, attrs):
    s = attrs["start"]
    out[...] = srcs[0][..., s:s + attrs["length"]]


@kernel("narrow_back")
def _narrow_back_numpy(out, srcs, attrs):
    g, s = srcs[0], attrs["start"]
    out.fill(0)
    out[..., s:s + g.shape[-1]] = g


@lowers("narrow", "narrow_back", kernels=("tg_narrow", "tg_narrow_back"))
def _narrow(node, at):
    """One thread per output element; the backward writes zeros outside the slice."""
    (src,) = node.srcs
    if node.op == "narrow":
        width, length, start = src.shape[-1], node.shape[-1], node.attrs["start"]
    else:
        width, length, start = node.shape[-1], src.shape[-1], node.attrs["start"]
    return [Launch(node.op.replace("narrow", "tg_narrow"), grid_1d(node.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(src)), i32_arg(node.size), i32_arg(width),
                    i32_arg(length), i32_arg(start)])]
