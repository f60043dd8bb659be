"""The numpy kernels of the cache family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.table import kernel


@kernel("cache_write")
def _cache_write_numpy(out, srcs, attrs):
    cache, value, start = srcs
    s = int(start[0])
    cache[..., s:s + value.shape[-2], :] = value
    if out is not cache:   # the numpy backend makes out the state itself (numpy_backend.py)
        out[...] = cache
