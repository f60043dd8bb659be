"""The stochastic family's engine replay (cpu.h beside this): dropout on f32 arrays, the
same mask as the numpy kernel (the hash is integer arithmetic; the step and micro-batch are
read from the hp row each time the node runs)."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.stochastic import HP_MICRO, HP_STEP, M32, threshold


@replays("dropout")
def _dropout(node, out, srcs, attrs):
    x, hp = srcs
    if f32_contiguous(out, x, hp) and out.shape == x.shape and hp.size > HP_MICRO:
        p = attrs["p"]
        scale = float(np.float32(1.0 / (1.0 - p)))
        return Call("dropout", [out, x, hp],
                    [x.size, threshold(p), attrs["seed"] & M32, attrs["salt"] & M32,
                     HP_STEP, HP_MICRO], [scale])
