"""The gated family's engine replay (cpu.h beside this): glu and glu_back on f32 arrays."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.gated import ACTS, up_offset


@replays("glu")
def _glu(node, out, srcs, attrs):
    if f32_contiguous(out, *srcs):
        return Call("glu", [out, *srcs], [out.size, ACTS[attrs["act"]][0]])


@replays("glu_back")
def _glu_back(node, out, srcs, attrs):
    gate = srcs[0]
    if f32_contiguous(out, *srcs):
        return Call("glu_back", [out, *srcs], [gate.size, ACTS[attrs["act"]][0],
                                               up_offset(gate.size)])
