"""The loss ops: cross_entropy over integer labels (-1 ignored) with its backward op,
count_valid (the number of labelled positions), and linear_cross_entropy, the output head
fused with the loss so no [N, vocab] logits exist. Builders, shape rules, backward rules,
numpy kernels (row chunks) and CUDA lowering (loss.cu, plus the matmul kernels the fused
head runs per chunk of rows).
"""
from __future__ import annotations

from toygraph.ops.shape import unpack
from toygraph.ops.table import F32, I32, INT32_MAX, LABELS, check, define_op, make_node


def cross_entropy(logits, labels, reduction="mean"):
    """Cross-entropy of logits [N, vocab] against integer labels [N]; label -1 is ignored.

    ``mean`` divides by the number of labels that are not ignored (0 when all are);
    ``sum`` does not divide, for token-weighted gradient accumulation."""
    return make_node("cross_entropy", [logits, labels], reduction=reduction)


def count_valid(labels):
    """The number of labels that are not -1, as an f32 scalar."""
    return make_node("count_valid", [labels])


def _infer_ce(shapes, dtypes, attrs):
    check(dtypes == [F32, I32], "cross_entropy needs f32 logits and i32 labels")
    check(len(shapes[0]) == 2 and tuple(shapes[1]) == shapes[0][:1],
          f"logits must be [N, vocab] and labels [N], got {shapes[0]} and {shapes[1]}")
    check(attrs["reduction"] in ("mean", "sum"), "reduction must be mean or sum")
    return (), F32


def _infer_ce_back(shapes, dtypes, attrs):
    return shapes[0], F32


define_op("cross_entropy", _infer_ce, lambda n, g, need: [
    make_node("cross_entropy_back", [n.srcs[0], n.srcs[1], g],
              reduction=n.attrs["reduction"]),
    None], id_ranges=lambda n: {1: (-1, n.srcs[0].shape[1], LABELS)})
define_op("cross_entropy_back", _infer_ce_back)
define_op("count_valid",
          lambda s, d, a: (check(d[0] == I32, "labels must be i32") or ((), F32)),
          id_ranges=lambda n: {0: (-1, INT32_MAX, "labels (-1 to ignore)")})


def linear_cross_entropy(h, w, labels, reduction="mean"):
    """cross_entropy(matmul(h, w, trans_b=True), labels, reduction) without [N, vocab] logits.

    ``reduction="none"`` gives the [N] per-row losses instead (0 on ignored rows): their
    negation is token_logprobs(matmul(h, w, trans_b=True), labels), the preference recipes'
    per-token log-probs.

    h [N, D] hidden states, w [V, D] the output head (a frozen, possibly quantized const or
    a trainable param), labels [N] i32 with -1 ignored. The kernels walk the rows in chunks,
    so only a [chunk, V] block of logits exists at a time, forward and backward (which
    recomputes it). The gradient is one ``linear_cross_entropy_back`` node packing dh and,
    only when w needs one, dw, read through ``unpack``.

    >>> loss = linear_cross_entropy(h, head, labels, reduction="sum")   # doctest: +SKIP

    It has no soft cap: models/decoder.py fused_head_loss refuses a model that caps its
    logits (Gemma 4).
    """
    return make_node("linear_cross_entropy", [h, w, labels], reduction=reduction)


def _infer_lce(shapes, dtypes, attrs):
    (hs, ws, ls), (hd, wd, ld) = shapes, dtypes
    check(hd == F32 and wd == F32 and ld == I32,
          f"linear_cross_entropy needs f32 h and w and i32 labels, got {hd}, {wd}, {ld}")
    check(len(hs) == 2 and len(ws) == 2 and hs[1] == ws[1],
          f"h must be [N, D] and w [V, D], got {hs} and {ws}")
    check(tuple(ls) == tuple(hs[:1]), f"labels must be [{hs[0]}], got {ls}")
    check(attrs["reduction"] in ("mean", "sum", "none"), "reduction must be mean, sum or none")
    return ((hs[0],) if attrs["reduction"] == "none" else ()), F32


def _infer_lce_back(shapes, dtypes, attrs):
    loss_shape, _ = _infer_lce(shapes[:3], dtypes[:3], attrs)
    check(tuple(shapes[3]) == loss_shape and dtypes[3] == F32,
          f"the loss gradient must be f32 {list(loss_shape)}, got {dtypes[3]} {list(shapes[3])}")
    check(attrs["grad_h"] or attrs["grad_w"], "linear_cross_entropy_back computes nothing")
    (n, d), v = shapes[0], shapes[1][0]
    return (n * d * attrs["grad_h"] + v * d * attrs["grad_w"],), F32


def _grad_lce(n, g, need):
    h, w, _ = n.srcs
    back = make_node("linear_cross_entropy_back", [*n.srcs, g],
                     reduction=n.attrs["reduction"], grad_h=bool(need[0]), grad_w=bool(need[1]))
    dh = unpack(back, 0, h.shape) if need[0] else None
    dw = unpack(back, h.size * need[0], w.shape) if need[1] else None
    return [dh, dw, None]


define_op("linear_cross_entropy", _infer_lce, _grad_lce,
    id_ranges=lambda n: {2: (-1, n.srcs[1].shape[0], LABELS)})
define_op("linear_cross_entropy_back", _infer_lce_back)
