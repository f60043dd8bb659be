"""The fused ops: attention (flash-style, no [T, T] scores) and the output head + loss
(linear_cross_entropy, no [N, vocab] logits), whose backward is one node packing every
source's gradient, read through ``unpack`` views. ops.py re-exports them."""
from __future__ import annotations

import numpy as np

from .optable import F32, I32, INT32_MAX, LABELS, check, check_floats, define_op, make_node


# --- fused attention -------------------------------------------------------------------------
def attention(q, k, v, *, scale: float, causal: bool = True, window: int = 0, segments=None):
    """softmax(scale * q k^T [causal-masked]) v without a [heads, seq, seq] tensor.

    ``segments`` (optional i32 [B, T], values >= 0) is sample packing's segment id per
    token: query i then also needs segments[b, i] == segments[b, j] to see key j, so the
    examples packed into one row never see each other (a block-diagonal mask, applied
    inside the kernels, never built as [T, T]). Without it every key of the row may be
    seen, as before.

    ``window`` > 0 is sliding-window causal attention (Gemma 3's local layers): query i
    sees key j iff j <= i and i - j < window. That is transformers' sliding overlay
    (masking_utils.sliding_window_overlay: ``kv_idx > q_idx - sliding_window``) and
    llama.cpp's LLAMA_SWA_TYPE_STANDARD (is_masked_swa masks ``p1 - p0 >= n_swa``).
    0 means no window.

    q [B, H, T, hd], k and v [B, KV, T, hd] with H % KV == 0: query head h reads K/V head
    h // (H / KV) (grouped-query). Returns [B, H, T, hd]. The gradient is one
    ``attention_back`` node (dq, dk and dv together, the way a flash-style kernel makes
    them) read through three ``unpack`` views.

    >>> o = attention(q, k, v, scale=hd ** -0.5)          # doctest: +SKIP
    """
    srcs = [q, k, v] if segments is None else [q, k, v, segments]
    return make_node("attention", srcs, scale=float(scale), causal=bool(causal),
                     window=int(window))


def attention_operands(node):
    """(q, k, v, segments or None, [o, g] for attention_back) of an attention node: the
    segment ids are an optional fourth source."""
    n = 3 if node.op == "attention" else 5
    segmented = len(node.srcs) > n
    q, k, v = node.srcs[:3]
    return q, k, v, node.srcs[3] if segmented else None, list(node.srcs[3 + segmented:])


def _infer_attention(shapes, dtypes, attrs):
    if len(shapes) == 4:
        seg = shapes[3]
        check(dtypes[3] == I32, f"segment ids must be i32, got {dtypes[3]}")
        check(tuple(seg) == (shapes[0][0], shapes[0][2]),
              f"segment ids must be [B, T] = [{shapes[0][0]}, {shapes[0][2]}], got {seg}")
        shapes, dtypes = shapes[:3], dtypes[:3]
    check_floats(dtypes)
    q, k, v = shapes[:3]
    check(len(q) == 4 and len(k) == 4, f"q must be [B, H, T, hd] and k, v [B, KV, T, hd], "
                                       f"got {q} and {k}")
    check(tuple(k) == tuple(v), f"k and v must share a shape, got {k} and {v}")
    check(q[0] == k[0] and q[2] == k[2] and q[3] == k[3],
          f"q {q} and k {k} must agree on batch, sequence and head_dim")
    check(q[1] % k[1] == 0, f"query heads {q[1]} must be a multiple of kv heads {k[1]}")
    check(attrs["window"] >= 0, f"window must be >= 0 (0: none), got {attrs['window']}")
    check(attrs["causal"] or not attrs["window"], "a sliding window needs causal=True")
    return tuple(q), F32


def _infer_attention_back(shapes, dtypes, attrs):
    n = len(shapes) - 2    # q, k, v[, segments], o, g
    _infer_attention(shapes[:n], dtypes[:n], attrs)
    check_floats(dtypes[n:])
    q, k = shapes[:2]
    o, g = shapes[n:]
    check(tuple(o) == tuple(q) and tuple(g) == tuple(q),
          f"output {o} and its gradient {g} must have q's shape {q}")
    return (int(np.prod(q)) + 2 * int(np.prod(k)),), F32


def _grad_attention(n, g, need):
    back = make_node("attention_back", [*n.srcs, n, g], **n.attrs)
    grads, offset = [], 0
    for s, nd in zip(n.srcs[:3], need):
        grads.append(unpack(back, offset, s.shape) if nd else None)
        offset += s.size
    return grads + [None] * (len(n.srcs) - 3)   # segment ids: integers, no gradient


def unpack(x, offset: int, shape):
    """Elements [offset, offset + prod(shape)) of x (read flat) as a tensor of ``shape``:
    how one node that packs several results (attention_back) hands them out."""
    return make_node("unpack", [x], offset=int(offset), shape=tuple(int(s) for s in shape))


def _infer_unpack(shapes, dtypes, attrs):
    off, shape = attrs["offset"], attrs["shape"]
    size = int(np.prod(shapes[0]))
    check(all(s > 0 for s in shape), f"unpack shape must be positive, got {shape}")
    check(0 <= off and off + int(np.prod(shape)) <= size,
          f"unpack [{off}, {off + int(np.prod(shape))}) lies outside {size} elements")
    return shape, dtypes[0]


#: Segment ids are only compared for equality; any non-negative int32 is one.
_SEGMENT_IDS = {3: (0, INT32_MAX, "segment ids (>= 0)")}
define_op("attention", _infer_attention, _grad_attention,
          id_ranges=lambda n: _SEGMENT_IDS if len(n.srcs) == 4 else {})
define_op("attention_back", _infer_attention_back,
          id_ranges=lambda n: _SEGMENT_IDS if len(n.srcs) == 6 else {})
define_op("unpack", _infer_unpack)


# --- fused output head + cross-entropy ---------------------------------------------------
def linear_cross_entropy(h, w, labels, reduction="mean"):
    """cross_entropy(matmul(h, w, trans_b=True), labels, reduction) without [N, vocab] logits.

    h [N, D] hidden states, w [V, D] the output head (a frozen, possibly quantized const or
    a trainable param), labels [N] i32 with -1 ignored. The kernels walk the rows in chunks,
    so only a [chunk, V] block of logits exists at a time, forward and backward (which
    recomputes it). The gradient is one ``linear_cross_entropy_back`` node packing dh and,
    only when w needs one, dw, read through ``unpack``.

    >>> loss = linear_cross_entropy(h, head, labels, reduction="sum")   # doctest: +SKIP
    """
    return make_node("linear_cross_entropy", [h, w, labels], reduction=reduction)


def _infer_lce(shapes, dtypes, attrs):
    (hs, ws, ls), (hd, wd, ld) = shapes, dtypes
    check(hd == F32 and wd == F32 and ld == I32,
          f"linear_cross_entropy needs f32 h and w and i32 labels, got {hd}, {wd}, {ld}")
    check(len(hs) == 2 and len(ws) == 2 and hs[1] == ws[1],
          f"h must be [N, D] and w [V, D], got {hs} and {ws}")
    check(tuple(ls) == tuple(hs[:1]), f"labels must be [{hs[0]}], got {ls}")
    check(attrs["reduction"] in ("mean", "sum"), "reduction must be mean or sum")
    return (), F32


def _infer_lce_back(shapes, dtypes, attrs):
    _infer_lce(shapes[:3], dtypes[:3], attrs)
    check(tuple(shapes[3]) == () and dtypes[3] == F32, f"the loss gradient must be an f32 "
                                                        f"scalar, got {shapes[3]}")
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
