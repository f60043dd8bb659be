"""The fused attention op: softmax(scale * q k^T [causal, optional sliding window]) v
without a [T, T] score tensor, grouped-query K/V sharing, optional attention sinks, and
its backward op attention_back (dq, dk, dv [and d sinks] packed in one node, read through
shape.unpack views).

The attention node packs its output o and the row log-sum-exp L [B, H, T] (o first, so
``attention`` hands out o as an unpack view at offset 0, which the buffer plan makes free);
attention_back reads both from the node itself, so no backward pass recomputes the row
statistics. Operands come heads-first ("bhtd": q [B, H, T, hd]) or token-major ("bthd":
q [B, T, H, hd], the projections' rows reshaped, so a model needs no permute); o, dO and
the gradients share q/k/v's layout, L is [B, H, T] in both.

Builder, shape rules, backward rule, numpy kernels (query blocks) and CUDA lowering
(flash_attention.cu, flash-style; tc_attention.py at bf16).
"""
from __future__ import annotations

import numpy as np

from toygraph.errors import GraphError
from toygraph.ops.groups import PACKED
from toygraph.ops.shape import unpack
from toygraph.ops.table import F32, I32, INT32_MAX, check, check_floats, define_op, make_node

#: Operand layouts: heads first (q [B, H, T, hd], k and v [B, KV, T, hd]) or token-major
#: (q [B, T, H, hd], k and v [B, T, KV, hd]: a projection's [B * T, heads * hd] rows
#: reshaped, read by the kernels through strides instead of permuted into a copy).
HEADS_FIRST, TOKEN_MAJOR = "bhtd", "bthd"

LAYOUTS = (HEADS_FIRST, TOKEN_MAJOR)


def attention(q, k, v, *, scale: float, causal: bool = True, window: int = 0, segments=None,
              sinks=None, layout: str = HEADS_FIRST, save_lse: bool = True):
    """softmax(scale * q k^T [causal-masked]) v without a [heads, seq, seq] tensor.

    ``sinks`` (optional f32 [H], gpt-oss's ``attn_sinks``): a learned logit per query head
    in every row's softmax denominator, as if each query also saw a key of score
    sinks[h] and value 0 (transformers' GptOssAttention concatenates it to the scores,
    llama.cpp's ggml_soft_max_add_sinks adds it). It takes probability from the keys and
    gets a gradient: d sinks[h] = -sum over rows of P_sink * rowsum(dO * O).

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

    ``layout`` "bhtd": q [B, H, T, hd], k and v [B, KV, T, hd]; "bthd" (token-major): q
    [B, T, H, hd], k and v [B, T, KV, hd]. H % KV == 0: query head h reads K/V head
    h // (H / KV) (grouped-query). Returns o in q's shape and layout: a view of the node,
    which also holds the row log-sum-exp L [B, H, T] for the backward (one
    ``attention_back`` node making dq, dk and dv together, the way a flash-style kernel
    makes them, read through three ``unpack`` views). ``save_lse=False`` leaves L out, for
    graphs that only run forward (generation's prefill); such a node has no gradient.

    >>> o = attention(q, k, v, scale=hd ** -0.5)          # doctest: +SKIP
    """
    srcs = [q, k, v] + ([] if segments is None else [segments]) + ([] if sinks is None else [sinks])
    node = make_node("attention", srcs, scale=float(scale), causal=bool(causal),
                     window=int(window), sinks=sinks is not None, layout=layout,
                     save_lse=bool(save_lse))
    return unpack(node, 0, q.shape)


def split_operands(srcs, op: str, attrs):
    """(q, k, v, segments or None, sinks or None, [the attention node, g] for
    attention_back) of the sources of an ``op`` node (tensors, or a numpy kernel's arrays):
    segment ids and sinks are optional sources after v (attrs["sinks"] says whether the
    sinks are there)."""
    n = 3 if op == "attention" else 5
    has_sinks = attrs.get("sinks", False)
    segmented = len(srcs) - has_sinks > n
    q, k, v = srcs[:3]
    seg = srcs[3] if segmented else None
    sinks = srcs[3 + segmented] if has_sinks else None
    return q, k, v, seg, sinks, list(srcs[3 + segmented + has_sinks:])


def attention_operands(node):
    """split_operands of an attention or attention_back node."""
    return split_operands(node.srcs, node.op, node.attrs)


def heads_first(shape, layout: str) -> tuple:
    """An operand's ``shape`` in ``layout`` as [B, heads, T, hd]."""
    B, a, b, d = shape
    return (B, b, a, d) if layout == TOKEN_MAJOR else (B, a, b, d)


def _infer_attention(shapes, dtypes, attrs):
    layout = attrs["layout"]
    check(layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {layout!r}")
    check(all(len(s) == 4 for s in shapes[:3]),
          f"q, k and v must be 4-d ({layout}), got {[tuple(s) for s in shapes[:3]]}")
    q, k, v = (heads_first(s, layout) for s in shapes[:3])
    if attrs.get("sinks"):
        check(dtypes[-1] == F32 and tuple(shapes[-1]) == (q[1],),
              f"sinks must be f32 [heads] = [{q[1]}], got {dtypes[-1]} {shapes[-1]}")
        shapes, dtypes = shapes[:-1], dtypes[:-1]
    if len(shapes) == 4:
        seg = shapes[3]
        check(dtypes[3] == I32, f"segment ids must be i32, got {dtypes[3]}")
        check(tuple(seg) == (q[0], q[2]),
              f"segment ids must be [B, T] = [{q[0]}, {q[2]}], got {seg}")
        shapes, dtypes = shapes[:3], dtypes[:3]
    check_floats(dtypes)
    check(tuple(k) == tuple(v), f"k and v must share a shape, got {shapes[1]} and {shapes[2]}")
    check(q[0] == k[0] and q[2] == k[2] and q[3] == k[3],
          f"q {shapes[0]} and k {shapes[1]} must agree on batch, sequence and head_dim "
          f"({layout})")
    check(q[1] % k[1] == 0, f"query heads {q[1]} must be a multiple of kv heads {k[1]}")
    check(attrs["window"] >= 0, f"window must be >= 0 (0: none), got {attrs['window']}")
    check(attrs["causal"] or not attrs["window"], "a sliding window needs causal=True")
    B, H, T, hd = q
    return (B * H * T * hd + (B * H * T if attrs["save_lse"] else 0),), F32


def _infer_attention_back(shapes, dtypes, attrs):
    n = len(shapes) - 2    # q, k, v[, segments][, sinks], the attention node, g
    packed, _ = _infer_attention(shapes[:n], dtypes[:n], attrs)
    check(attrs["save_lse"], "the attention node must hold its row log-sum-exp (save_lse)")
    check_floats(dtypes[n:])
    q, k = shapes[:2]
    fwd, g = shapes[n:]
    check(tuple(fwd) == packed and tuple(g) == tuple(q),
          f"the attention node {fwd} must be {packed} and the gradient {g} q's shape {q}")
    return (int(np.prod(q)) + 2 * int(np.prod(k)) + (heads_first(q, attrs["layout"])[1]
                                                     if attrs.get("sinks") else 0),), F32


def backward_node(node, g):
    """The attention_back node of attention ``node`` (the packed node, not its o view)
    given dO ``g``: dq, dk, dv (and d sinks) packed in that order, from q, k, v, o and L."""
    if not node.attrs["save_lse"]:
        raise GraphError(f"attention {node.name!r} was built with save_lse=False (forward "
                         f"only): it has no gradient")
    return make_node("attention_back", [*node.srcs, node, g], **node.attrs)


def _grad_attention(n, views, need):
    """dq, dk, dv (and d sinks) are views into one attention_back node; segment ids are
    integers and get no gradient. Only o has a gradient (the packed group, groups.PACKED: {0: dO})."""
    if set(views) != {0}:
        raise GraphError(f"attention {n.name!r}: only its output o has a gradient, not the "
                         f"row log-sum-exp it saves for the backward")
    back = backward_node(n, views[0])
    segmented = attention_operands(n)[3] is not None
    grads, offset = [], 0
    for i, (s, nd) in enumerate(zip(n.srcs, need)):
        if i == 3 and segmented:
            grads.append(None)
            continue
        grads.append(unpack(back, offset, s.shape) if nd else None)
        offset += s.size
    return grads


#: Segment ids are only compared for equality; any non-negative int32 is one.
_SEGMENT_IDS = {3: (0, INT32_MAX, "segment ids (>= 0)")}

define_op("attention", _infer_attention, _grad_attention, groups={PACKED},
          id_ranges=lambda n: _SEGMENT_IDS if attention_operands(n)[3] is not None else {})
define_op("attention_back", _infer_attention_back,
          id_ranges=lambda n: _SEGMENT_IDS if attention_operands(n)[3] is not None else {})
