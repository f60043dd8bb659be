"""The slicing family's engine replay (cpu.h beside this): narrow as the shape family's
strided copy (the rows' columns from ``start`` on), narrow_back as its own kernel, on f32
arrays."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.shape.cpu import copy_call, row_major


@replays("narrow")
def _narrow(node, out, srcs, attrs):
    x = srcs[0]
    if f32_contiguous(out, x) and x.ndim >= 1:
        return copy_call(out, x, row_major(x.shape), attrs["start"])


@replays("narrow_back")
def _narrow_back(node, out, srcs, attrs):
    g, width = srcs[0], out.shape[-1]
    length, start = g.shape[-1], attrs["start"]
    if f32_contiguous(out, g) and g.ndim >= 1 and 0 <= start and start + length <= width:
        return Call("narrow_back", [out, g], [out.size // width, width, start, length])
