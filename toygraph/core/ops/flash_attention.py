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

from toygraph.core.ops.groups import PACKED
from toygraph.core.ops.shape import unpack
from toygraph.core.ops.tc_attention import (TC_ATTENTION_PRECISION, tc_attention_launches,
                                            tc_scratch)
from toygraph.core.precision import TENSOR_CORE_PRECISIONS
from toygraph.core.ops.table import (F32, I32, INT32_MAX, check, check_floats, define_op, kernel,
                                     make_node)
from toygraph.cuda.lowering import (MAX_GRID_YZ, Launch, declare_kernels, f32_arg, i32_arg, lowers,
                                    ptr_arg, rows_grid)
from toygraph.cuda.lowering.constants import ATTN_TILES
from toygraph.errors import CudaError, GraphError

# The family's CUDA kernels, beside this module: the f32 kernels in every module; ldmatrix /
# cp.async (tc_async.cuh, usable by any tensor-core kernel) and the tensor-core attention
# only in the tensor-core precisions' modules, so the f32 module stays as it is.
declare_kernels(__file__, "flash_attention.cu")
declare_kernels(__file__, "tc_async.cuh", precisions=TENSOR_CORE_PRECISIONS)
declare_kernels(__file__, "tc_attention.cu", precisions=TENSOR_CORE_PRECISIONS,
                needs=("flash_attention.cu", "tc_matmul.cu", "tc_async.cuh"))


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


def attention_dims(node) -> tuple[int, int, int, int, int]:
    """(B, H, KV, T, hd) of an attention or attention_back node, whatever its layout."""
    B, H, T, hd = heads_first(node.srcs[0].shape, node.attrs["layout"])
    return B, H, heads_first(node.srcs[1].shape, node.attrs["layout"])[1], T, hd


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


# --- numpy kernels -----------------------------------------------------------------------------

# Query rows per block: the scores of one block are [B, KV, group * rows, keys], never the
# whole [B, H, T, T]. The grouped query heads that share a K/V head are folded into the
# rows, so each block is one BLAS matmul per (batch, kv head).
ATTN_ROWS = 256


def _attn_blocks(q, k, attrs, segments=None, sinks=None):
    """Per query block [i0, i1): the visible keys [j0, j1) as a slice, the block's queries
    folded to [B, KV, G * rows, hd], its probabilities softmax(scale * q k^T)
    [B, KV, G * rows, j1 - j0], with ``sinks`` [H] each row's sink probability
    [1 or B, KV, G * rows, 1] (else None), and the rows' log-sum-exp L [B, KV, G * rows, 1]
    (q, k heads first). Query i sees key j iff j <= i (causal), i - j < window (when
    window > 0) and, with ``segments`` [B, T], segments[b, i] == segments[b, j], so keys
    past the block's last query and before its first query's window are never multiplied;
    other segments' keys are masked per block, never as a [T, T] array."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    window = attrs["window"]
    q5 = q.reshape(B, KV, G, T, hd)
    for i0 in range(0, T, ATTN_ROWS):
        i1 = min(i0 + ATTN_ROWS, T)
        rows = i1 - i0
        j1 = i1 if attrs["causal"] else T
        j0 = max(0, i0 - window + 1) if window else 0
        keys = slice(j0, j1)
        qb = q5[:, :, :, i0:i1].reshape(B, KV, G * rows, hd)
        probs = np.matmul(qb, np.swapaxes(k[:, :, keys], -1, -2))
        probs *= probs.dtype.type(attrs["scale"])
        masked = np.zeros((1, rows, j1 - j0), bool)
        if attrs["causal"]:
            i, j = np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :]
            masked = masked | ((j > i) | (i - j >= window) if window else j > i)
        if segments is not None:
            masked = masked | (segments[:, i0:i1, None] != segments[:, None, keys])
        if masked.any():
            np.copyto(probs.reshape(B, KV, G, rows, j1 - j0), -np.inf,
                      where=masked[:, None, None])
        psink = None
        top = probs.max(axis=-1, keepdims=True)
        if sinks is not None:  # one more logit per row, sinks[h], with value 0
            sink = np.repeat(sinks.reshape(1, KV, G, 1), rows, axis=3).reshape(1, KV, G * rows, 1)
            top = np.maximum(top, sink)
        probs -= top
        np.exp(probs, out=probs)
        den = probs.sum(axis=-1, keepdims=True)
        if sinks is not None:
            psink = np.exp(sink - top)
            den = den + psink
            psink = psink / den
        probs /= den
        yield i0, i1, keys, qb, probs, psink, top + np.log(den)


def _fold(x5, i0, i1):
    """Rows [i0, i1) of a [B, KV, G, T, d] array as [B, KV, G * rows, d]."""
    B, KV, G, _, d = x5.shape
    return x5[:, :, :, i0:i1].reshape(B, KV, G * (i1 - i0), d)


def _heads(x, layout: str):
    """An operand or result in ``layout`` as [B, heads, T, d]: a view to write through."""
    return np.swapaxes(x, 1, 2) if layout == TOKEN_MAJOR else x


def _read(x, layout: str):
    """An operand as a contiguous [B, heads, T, d] array: a token-major one copied, so
    every product below sees the arrays a heads-first graph gives it (the same bits)."""
    return np.ascontiguousarray(_heads(x, layout))


def _unfold(x, B, H):
    """[B, KV, G * rows, d] (query rows folded per kv head) as [B, H, rows, d]."""
    return x.reshape(B, H, -1, x.shape[-1])


@kernel("attention")
def _attention_numpy(out, srcs, attrs):
    """o (in q's layout), then L [B, H, T] when the node saves it."""
    layout = attrs["layout"]
    q, k, v, seg, sinks, _ = split_operands(srcs, "attention", attrs)
    o = _heads(out[:q.size].reshape(q.shape), layout)
    q, k, v = (_read(x, layout) for x in (q, k, v))
    B, H, T, _ = q.shape
    lse = out[q.size:].reshape(B, H, T) if attrs["save_lse"] else None
    for i0, i1, keys, _, pr, _, lb in _attn_blocks(q, k, attrs, seg, sinks):
        o[:, :, i0:i1] = _unfold(np.matmul(pr, v[:, :, keys]), B, H)
        if lse is not None:
            lse[:, :, i0:i1] = _unfold(lb, B, H)[..., 0]


@kernel("attention_back")
def _attention_back_numpy(out, srcs, attrs):
    """[dq, dk, dv (, d sinks)] packed flat, from the recomputed probabilities block by
    block: dv = P^T dO, dS = P * (dO V^T - rowsum(dO * O)) * scale, dq = dS K, dk = dS^T Q,
    d sinks[h] = -sum of P_sink * rowsum(dO * O) over h's rows. The saved L is not read:
    the probabilities are made as the forward made them (exp(s - max) / sum), so numpy's
    gradients keep their bits; the CUDA kernels read L instead of a statistics pass."""
    layout = attrs["layout"]
    q, k, v, seg, sinks, (fwd, g) = split_operands(srcs, "attention_back", attrs)
    nq, nk = q.size, k.size
    dq = _heads(out[:nq].reshape(q.shape), layout)
    dk = _heads(out[nq:nq + nk].reshape(k.shape), layout)
    dv = _heads(out[nq + nk:nq + 2 * nk].reshape(k.shape), layout)
    dsinks = out[nq + 2 * nk:]   # [H] = [KV, G] with sinks, else empty
    out[nq:].fill(0)
    o = fwd[:nq].reshape(q.shape)
    q, k, v, g, o = (_read(x, layout) for x in (q, k, v, g, o))
    B, H, T, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    g5, o5 = g.reshape(B, KV, G, T, hd), o.reshape(B, KV, G, T, hd)
    scale = out.dtype.type(attrs["scale"])
    for i0, i1, keys, qb, pr, psink, _ in _attn_blocks(q, k, attrs, seg, sinks):
        gb = _fold(g5, i0, i1)
        delta = np.sum(gb * _fold(o5, i0, i1), axis=-1, keepdims=True)
        if psink is not None:
            dsinks -= (psink * delta).sum(axis=(0, 3)).reshape(KV, G, i1 - i0).sum(axis=2).ravel()
        dv[:, :, keys] += np.matmul(np.swapaxes(pr, -1, -2), gb)
        ds = np.matmul(gb, np.swapaxes(v[:, :, keys], -1, -2))
        ds -= delta
        ds *= pr
        ds *= scale
        dq[:, :, i0:i1] = _unfold(np.matmul(ds, k[:, :, keys]), B, H)
        dk[:, :, keys] += np.matmul(np.swapaxes(ds, -1, -2), qb)


# --- CUDA lowering (flash_attention.cu) -------------------------------------------------------
def attention_config(hd: int) -> tuple[int, int, int]:
    """(HD, BT, TPR) of the kernels that run head_dim ``hd``: the smallest HD >= hd."""
    for HD in sorted(ATTN_TILES):
        if hd <= HD:
            return (HD, *ATTN_TILES[HD])
    raise CudaError(f"attention: head_dim {hd} exceeds the kernels' maximum {max(ATTN_TILES)}")


def _attention_scratch(node, precision: str) -> int:
    """attention_back: D = rowsum(dO * O), [B, H, T] (L is the attention node's); at bf16
    the tensor-core kernels' (tc_attention.tc_scratch), for the forward too."""
    B, H, _, T, _ = dims = attention_dims(node)
    if precision == TC_ATTENTION_PRECISION:
        return tc_scratch(node, dims)
    return 0 if node.op == "attention" else 4 * B * H * T


@lowers("attention", scratch=_attention_scratch, bf16_reads=(0, 1, 2),
        kernels=("tg_attn_fwd_32", "tg_attn_fwd_64", "tg_attn_fwd_128"))
@lowers("attention_back", scratch=_attention_scratch, bf16_reads=(0, 1, 2, -1),
        kernels=("tg_attn_bwd_prep_32", "tg_attn_bwd_prep_64", "tg_attn_bwd_prep_128",
                 "tg_attn_bwd_dkdv_32", "tg_attn_bwd_dkdv_64", "tg_attn_bwd_dkdv_128",
                 "tg_attn_bwd_dq_32", "tg_attn_bwd_dq_64", "tg_attn_bwd_dq_128",
                 "tg_attn_bwd_sinks"))
def _attention(node, at) -> list[Launch]:
    """attention: one launch, a block per (query tile, head, batch), writing o and L into
    the packed output. attention_back: D into scratch, then dk/dv per (key tile, kv head,
    batch) and dq per (query tile, head, batch) from the attention node's o and L, written
    straight into the packed [dq, dk, dv] output. The kernels are instantiated per head_dim
    bound HD (constants.ATTN_TILES), named ``_HD``; the last argument says whether the
    operands are token-major (strided rows). Optional segment ids (sample packing) and
    sinks pass as pointers after the float operands, null pointers without them; with
    sinks, attention_back ends with their gradient (tg_attn_bwd_sinks, one block per head,
    from L and D). At precision "bf16" the tensor-core kernels run instead
    (tc_attention.py)."""
    out, ptr = at.out, at.ptr
    operands = q, k, v, seg, sinks, rest = attention_operands(node)
    B, H, KV, T, hd = dims = attention_dims(node)
    if max(H, B) > MAX_GRID_YZ:
        raise CudaError(f"attention {node.name!r}: {B} x {H} exceeds the grid limit")
    # The packed attention node: o (q's size), then L [B, H, T] when it is saved.
    packed = out if node.op == "attention" else ptr(rest[0])
    lse = packed + 4 * q.size if node.attrs["save_lse"] else 0
    token_major = node.attrs["layout"] == TOKEN_MAJOR
    if at.precision == TC_ATTENTION_PRECISION:   # tensor cores (tc_attention.py)
        return tc_attention_launches(node, at, dims, token_major, lse, operands)
    segs = ptr_arg(ptr(seg) if seg is not None else 0)
    sink = ptr_arg(ptr(sinks) if sinks is not None else 0)
    tok = i32_arg(token_major)
    HD, BT, TPR = attention_config(hd)
    tiles = (T + BT - 1) // BT
    common = [i32_arg(H), i32_arg(KV), i32_arg(T), i32_arg(hd), f32_arg(node.attrs["scale"]),
              i32_arg(node.attrs["causal"]), i32_arg(node.attrs["window"]), tok]
    block = (BT * TPR, 1, 1)
    per_head, per_kv = (tiles, H, B), (tiles, KV, B)
    if node.op == "attention":
        return [Launch(f"tg_attn_fwd_{HD}", per_head,
                       [ptr_arg(out), ptr_arg(lse), ptr_arg(ptr(q)), ptr_arg(ptr(k)),
                        ptr_arg(ptr(v)), segs, sink, *common],
                       block)]
    g = rest[1]
    delta = at.scratch
    dq, dk, dv = out, out + 4 * q.size, out + 4 * (q.size + k.size)
    stats = [ptr_arg(lse), ptr_arg(delta), segs]
    qkvg = [ptr_arg(ptr(q)), ptr_arg(ptr(k)), ptr_arg(ptr(v)), ptr_arg(ptr(g))]
    launches = [Launch(f"tg_attn_bwd_prep_{HD}", per_head,
                       [ptr_arg(delta), ptr_arg(packed), ptr_arg(ptr(g)), i32_arg(H), i32_arg(T),
                        i32_arg(hd), tok], block),
                Launch(f"tg_attn_bwd_dkdv_{HD}", per_kv,
                       [ptr_arg(dk), ptr_arg(dv), *qkvg, *stats, *common], block),
                Launch(f"tg_attn_bwd_dq_{HD}", per_head, [ptr_arg(dq), *qkvg, *stats,
                                                          *common], block)]
    if sinks is not None:
        dsinks = out + 4 * (q.size + 2 * k.size)
        launches.append(Launch("tg_attn_bwd_sinks", rows_grid(H),
                               [ptr_arg(dsinks), sink, ptr_arg(lse), ptr_arg(delta), i32_arg(B),
                                i32_arg(H), i32_arg(T)]))
    return launches
