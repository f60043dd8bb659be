"""The numpy kernel table: op name -> ``kernel(out, srcs, attrs)``, filled by the
``@kernel(name)`` decorator in kernels.py and fused.py."""
from __future__ import annotations

KERNELS = {}


def kernel(name):
    def register(fn):
        KERNELS[name] = fn
        return fn
    return register
