"""The preference family's engine replay (cpu.h beside this): token_logprobs(+back) on f32
logits [N, V] and i32 labels [N], softplus(+back) and log1mexp(+back) on f32 arrays of one
shape."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.elementwise.cpu import elementwise_replays
from toygraph.ops.loss.cpu import _labels_fit   # the same [N, V] logits and [N] labels


@replays("token_logprobs")
def _token_logprobs(node, out, srcs, attrs):
    logits, labels = srcs
    if f32_contiguous(out, logits) and _labels_fit(logits, labels) and out.shape == labels.shape:
        return Call("token_logprobs", [out, logits, labels], list(logits.shape))


@replays("token_logprobs_back")
def _token_logprobs_back(node, out, srcs, attrs):
    logits, labels, g = srcs
    if (f32_contiguous(out, logits, g) and _labels_fit(logits, labels)
            and out.shape == logits.shape and g.shape == labels.shape):
        return Call("token_logprobs_back", [out, logits, labels, g], list(logits.shape))


elementwise_replays(["softplus", "softplus_back", "log1mexp", "log1mexp_back"])
