"""The elementwise family's engine replay (cpu.h beside this): add, sub, mul and scale of
f32 arrays of one shape (a broadcast keeps its numpy kernel)."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays


def _same_shape(out, srcs) -> bool:
    return f32_contiguous(out, *srcs) and all(s.shape == out.shape for s in srcs)


def _binary(op):
    @replays(op)
    def call(node, out, srcs, attrs):
        if _same_shape(out, srcs):
            return Call(op, [out, *srcs], [out.size])
    return call


for _op in ("add", "sub", "mul"):
    _binary(_op)


@replays("scale")
def _scale(node, out, srcs, attrs):
    if _same_shape(out, srcs):
        return Call("scale", [out, srcs[0], None], [out.size], [attrs["s"]])
