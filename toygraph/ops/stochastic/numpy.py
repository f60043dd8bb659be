"""The numpy kernels of the stochastic family (the reference backend; its ops and their rules are
in __init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.stochastic import HP_MICRO, HP_STEP, M32, threshold
from toygraph.ops.table import kernel


# --- the hash, as stochastic.cu computes it -----------------------------------------------------
def fmix32(h):
    """MurmurHash3's 32-bit finalizer (a bijection), on Python ints or uint32 arrays."""
    if isinstance(h, np.ndarray):
        h = h.astype(np.uint32)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
        return h
    h &= M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def stream_key(seed: int, salt: int, step: int, micro: int) -> int:
    """The per-launch key: the seed, salt, step and micro-batch folded in one at a time."""
    k = fmix32(seed ^ 0x9E3779B9)
    for v in (salt, step, micro):
        k = fmix32(k ^ (v & M32))
    return k


def keep_mask(n: int, p: float, seed: int, salt: int, step: int, micro: int) -> np.ndarray:
    """Which of n elements a dropout keeps (bool [n])."""
    key = stream_key(seed, salt, step, micro)
    idx = np.arange(n, dtype=np.uint64).astype(np.uint32)
    h = fmix32(fmix32(idx + np.uint32(key)) ^ np.uint32(fmix32(key ^ 0x68E31DA4)))
    return (h >> np.uint32(8)) >= np.uint32(threshold(p))


@kernel("dropout")
def _dropout_numpy(out, srcs, attrs):
    x, hp = srcs
    step, micro = int(hp[HP_STEP]), int(hp[HP_MICRO])
    if step == 0 or threshold(attrs["p"]) == 0:   # as the kernel: no step, or nothing drops
        out[...] = x
        return
    keep = keep_mask(x.size, attrs["p"], attrs["seed"], attrs["salt"], step, micro)
    scale = x.dtype.type(np.float32(1.0 / (1.0 - attrs["p"])))
    out[...] = np.where(keep.reshape(x.shape), x * scale, x.dtype.type(0))
