"""CUDA lowering of the KV-cache op (cache.cu): cache_write updates its cache in place and
outputs the cache after the write."""
from __future__ import annotations

from .launch import Launch, _blocks, i32, p
from .registry import lowers


@lowers("cache_write", kernels=("tg_cache_write",))
def _cache_write(node, at):
    cache, value, start = node.srcs
    rows, d = cache.shape[-2:]
    return [Launch("tg_cache_write", _blocks(node.size),
                   [p(at.out), p(at.ptr(cache)), p(at.ptr(value)), p(at.ptr(start)),
                    i32(node.size), i32(rows), i32(value.shape[-2]), i32(d)])]
