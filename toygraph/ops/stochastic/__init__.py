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

from toygraph.ops.table import F32, check, check_floats, define_op, make_node

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
