"""The KV-cache op of generation (toygraph/inference/kvcache.py): cache_write writes new keys or
values into a persistent cache at an uploaded position. Builder, shape rule, numpy kernel
and CUDA lowering (cache.cu). Not differentiable: generation graphs have no backward."""
from __future__ import annotations

from toygraph.ops.table import F32, I32, check, define_op, make_node


def cache_write(cache, value, start):
    """Write ``value`` [..., T, d] into rows [start, start + T) of ``cache`` [..., L, d]
    (a ``state`` tensor, updated in place) and return the whole cache after the write.

    ``start`` is an i32 [1] input, uploaded per run (the position of the first new token),
    so one realized graph writes anywhere in the cache. The returned value is a copy of
    the updated cache: an op that reads it (the decode step's attention) is thereby ordered
    after the write, which a pure side effect could not promise. Not differentiable:
    generation graphs have no backward.

    >>> kc = cache_write(k_cache, k_new, pos)     # k_new [1, KV, 1, hd] at row pos  # doctest: +SKIP
    """
    return make_node("cache_write", [cache, value, start])


def _infer_cache_write(shapes, dtypes, attrs):
    (cs, vs, ss), (cd, vd, sd) = shapes, dtypes
    check(cd == F32 and vd == F32 and sd == I32,
          f"cache_write needs an f32 cache and value and an i32 start, got {cd}, {vd}, {sd}")
    check(len(cs) >= 2 and len(vs) == len(cs), f"cache [..., L, d] and value [..., T, d] "
                                               f"must have the same rank >= 2, got {cs} and {vs}")
    check(tuple(vs[:-2]) == tuple(cs[:-2]) and vs[-1] == cs[-1],
          f"value {vs} must match cache {cs} on every axis but the rows")
    check(vs[-2] <= cs[-2], f"{vs[-2]} rows do not fit in a cache of {cs[-2]}")
    check(tuple(ss) == (1,), f"start must be a [1] tensor, got {ss}")
    return tuple(cs), F32


define_op("cache_write", _infer_cache_write,
          id_ranges=lambda n: {2: (0, n.srcs[0].shape[-2] - n.srcs[1].shape[-2] + 1,
                                   "the cache rows the new ones fit in")})
