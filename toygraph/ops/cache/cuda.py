"""The CUDA lowering of the cache family (kernels in cache.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import Launch, declare_kernels, grid_1d, i32_arg, lowers, ptr_arg

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "cache.cu")


@lowers("cache_write", kernels=("tg_cache_write",))
def _cache_write(node, at):
    """Updates the cache in place and outputs the cache after the write."""
    cache, value, start = node.srcs
    rows, d = cache.shape[-2:]
    return [Launch("tg_cache_write", grid_1d(node.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(cache)), ptr_arg(at.ptr(value)),
                    ptr_arg(at.ptr(start)), i32_arg(node.size), i32_arg(rows),
                    i32_arg(value.shape[-2]), i32_arg(d)])]
