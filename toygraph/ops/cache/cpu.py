"""The cache family's engine replay (cpu.h beside this): cache_write of f32 rows at an
uploaded i32 start."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, replays


@replays("cache_write")
def _cache_write(node, out, srcs, attrs):
    cache, value, start = srcs
    if not (f32_contiguous(out, cache, value) and start.dtype == np.int32 and start.size == 1):
        return None
    L, d = cache.shape[-2:]
    return Call("cache_write", [out, cache, value, start],
                [cache.size // (L * d), L, value.shape[-2], d])
