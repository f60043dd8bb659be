"""dropout: a counter-based random mask inside the replayed graph. Builder, shape rule,
backward rule (the same mask on the gradient), numpy kernel and CUDA lowering
(stochastic.cu).

Element i of a dropout node keeps its value, times 1 / (1 - p), when
``(h >> 8) >= threshold``, h a 32-bit hash of (seed, salt, optimizer step t, micro-batch,
i) and threshold = round(p * 2^24). The step t and the micro-batch index arrive in the
uploaded hp row (core/optimizer.py: its entries HP_STEP and HP_MICRO), so a replayed step
draws a fresh mask, the same step draws the same one again (a resumed run stays
bit-exact), and numpy and the CUDA kernel compute the same bits: unsigned 32-bit integer
arithmetic only. t = 0 (no optimizer step: evaluation) makes it the identity.
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                    ptr_arg)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "stochastic.cu")

#: Where the hp row (core/optimizer.hp_row) holds the optimizer step and the micro-batch.
HP_STEP, HP_MICRO = 7, 8
M32 = 0xFFFFFFFF


def dropout(x, hp, *, p: float, seed: int, salt: int):
    """x * keep / (1 - p), keep drawn per element from (seed, salt, step, micro-batch);
    ``salt`` tells apart the dropouts of one graph (each LoRA module has its own)."""
    check(0.0 <= p < 1.0, f"dropout probability must be in [0, 1), got {p}")
    return make_node("dropout", [x, hp], p=float(p), seed=int(seed) & M32, salt=int(salt) & M32)


def threshold(p: float) -> int:
    """The 24-bit threshold below which an element is dropped."""
    return int(round(p * (1 << 24)))


def _infer_dropout(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(len(shapes[1]) == 1 and shapes[1][0] > HP_MICRO,
          f"dropout reads the step from the hp row, got a {shapes[1]} tensor")
    return shapes[0], F32


define_op("dropout", _infer_dropout,
          lambda n, g, need: [make_node("dropout", [g, n.srcs[1]], **n.attrs), None])


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


# --- CUDA lowering (stochastic.cu) --------------------------------------------------------------
def _signed(v: int) -> int:
    """A uint32 as the int32 with its bits (the kernel reads it back as unsigned)."""
    return v - (1 << 32) if v >= 1 << 31 else v


@lowers("dropout", kernels=("tg_dropout",))
def _dropout(node, at):
    x, hp = node.srcs
    a = node.attrs
    return [Launch("tg_dropout", grid_1d(x.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(x)), ptr_arg(at.ptr(hp)), i32_arg(x.size),
                    i32_arg(_signed(a["seed"])), i32_arg(_signed(a["salt"])),
                    i32_arg(threshold(a["p"])), f32_arg(np.float32(1.0 / (1.0 - a["p"])))])]
