"""The loss family's engine replay (cpu.h beside this): cross_entropy ("sum" and "mean"),
its backward and count_valid, on f32 logits [N, V] and i32 labels [N]."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, replays


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
