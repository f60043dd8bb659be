"""The rotary family's engine replay (cpu.h beside this): rope on f32 x [B, T, H, hd] at
i32 positions [B, T]."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, replays


@replays("rope")
def _rope(node, out, srcs, attrs):
    x, pos = srcs[:2]
    factors = srcs[2] if len(srcs) == 3 else None
    if not (f32_contiguous(out, x) and x.ndim == 4 and pos.shape == x.shape[:2]
            and pos.dtype == np.int32 and pos.flags.c_contiguous
            and (factors is None or f32_contiguous(factors))):
        return None
    B, T, H, hd = x.shape
    return Call("rope", [out, x, pos, factors],
                [B * T, H, hd, attrs["dims"], attrs["mode"] == "neox", attrs["inverse"]],
                [attrs["base"], attrs["freq_scale"]])
