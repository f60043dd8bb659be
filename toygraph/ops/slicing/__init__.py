"""narrow: a slice of the last axis, x[..., start:start + length], and its backward (the
gradient placed back in zeros). Qwen3.5 splits its fused projections with it (the gated
query's [q | gate] per head, the DeltaNet's conv output [q | k | v]). Builder, shape rule,
backward rule, numpy kernels and CUDA lowering (slicing.cu)."""
from __future__ import annotations

from toygraph.ops.table import F32, check, define_op, make_node


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
