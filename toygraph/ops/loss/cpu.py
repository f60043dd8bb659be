"""The loss family's engine replay (cpu.h beside this): cross_entropy ("sum" and "mean"),
its backward and count_valid, on f32 logits [N, V] and i32 labels [N]; the fused head and
loss (linear_cross_entropy and its backward), the head in f32 or in its GGUF blocks."""
from __future__ import annotations

import numpy as np

from toygraph.cpu import engine
from toygraph.cpu.block_tensor import BlockTensor
from toygraph.cpu.replay import Call, f32_contiguous, hands_off, replays


def _labels_fit(logits, labels) -> bool:
    return (logits.ndim == 2 and labels.dtype == np.int32 and labels.flags.c_contiguous
            and labels.shape == logits.shape[:1])


@replays("cross_entropy")
def _cross_entropy(node, out, srcs, attrs):
    logits, labels = srcs
    if (attrs["reduction"] in ("sum", "mean") and f32_contiguous(out, logits)
            and out.size == 1 and _labels_fit(logits, labels)):
        return Call("cross_entropy", [out, logits, labels],
                    [*logits.shape, attrs["reduction"] == "mean"])


@replays("cross_entropy_back")
def _cross_entropy_back(node, out, srcs, attrs):
    logits, labels, g = srcs
    if (attrs["reduction"] in ("sum", "mean") and f32_contiguous(out, logits, g)
            and g.size == 1 and _labels_fit(logits, labels) and out.shape == logits.shape):
        return Call("cross_entropy_back", [out, logits, labels, g],
                    [*logits.shape, attrs["reduction"] == "mean"])


@replays("count_valid")
def _count_valid(node, out, srcs, attrs):
    labels = srcs[0]
    if (f32_contiguous(out) and out.size == 1 and labels.dtype == np.int32
            and labels.flags.c_contiguous):
        return Call("count_valid", [out, labels], [labels.size])


_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _head(w):
    """(address of W, fmt (-1: f32), row bytes, V, D, the few-rows kernel) of the head, or
    None where the engine does not take it."""
    if isinstance(w, BlockTensor):
        if not w.computes_on_blocks:
            return None
        weight = w.weight()
        return (weight.data, engine.FORMATS.index(weight.fmt), weight.row_bytes, weight.N,
                weight.K, weight.few_rows_kernel)
    if f32_contiguous(w) and w.ndim == 2:
        return w, -1, 4 * w.shape[1], w.shape[0], w.shape[1], 0
    return None


@replays("linear_cross_entropy")
def _linear_cross_entropy(node, out, srcs, attrs):
    h, w, labels = srcs
    head = _head(w)
    if head is None or not (f32_contiguous(out, h) and h.ndim == 2 and _labels_fit(h, labels)):
        return None
    data, fmt, row_bytes, V, D, few = head
    return Call("linear_cross_entropy", [out, h, data, labels],
                [h.shape[0], V, fmt, row_bytes, D, few, _REDUCTIONS[attrs["reduction"]]])


@replays("linear_cross_entropy_back")
def _linear_cross_entropy_back(node, out, srcs, attrs):
    h, w, labels, g = srcs
    head = _head(w)
    if head is None or not (f32_contiguous(out, h, g) and h.ndim == 2 and _labels_fit(h, labels)):
        return None
    data, fmt, row_bytes, V, D, few = head
    if attrs["grad_w"] and fmt >= 0:
        return None
    return Call("linear_cross_entropy_back", [out, h, data, labels, g],
                [h.shape[0], V, fmt, row_bytes, D, few, _REDUCTIONS[attrs["reduction"]],
                 attrs["grad_h"], attrs["grad_w"]])


@hands_off("linear_cross_entropy", "linear_cross_entropy_back")
def _lce_handoff(forward: Call, backward: Call, cell) -> None:
    """The forward leaves its first chunk's softmax(z) - onehot in ``cell`` (cpu.h's
    LceHandoff) for the backward, which would recompute it: a product over the whole
    vocabulary less per step, the same bits."""
    forward.pointers.append(cell)
    backward.pointers.append(cell)
