"""numpy kernel of the KV-cache op (ops_cache.py), registered in the same KERNELS table as
kernels.py's."""
from __future__ import annotations

from .registry import kernel


@kernel("cache_write")
def _cache_write(out, srcs, attrs):
    cache, value, start = srcs
    s = int(start[0])
    cache[..., s:s + value.shape[-2], :] = value
    out[...] = cache
