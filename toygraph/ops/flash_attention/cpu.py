"""The flash_attention family's engine replay (cpu.h beside this): attention and
attention_back on f32 operands of one sequence length, in either layout, with causal and
sliding-window masks, packed segments and sinks; and generation's attention over its KV
cache, fused."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, fuses, replays
from toygraph.ops.flash_attention import TOKEN_MAJOR, heads_first, split_operands


def _shape(q, k, seg, attrs):
    """(B, H, KV, T, hd) when the kernel takes these operands, else None."""
    layout = attrs["layout"]
    (B, H, T, hd), (Bk, KV, Tk, hdk) = heads_first(q.shape, layout), heads_first(k.shape, layout)
    if (Bk, Tk, hdk) != (B, T, hd) or KV == 0 or H % KV:
        return None
    if attrs["window"] and not attrs["causal"]:   # the numpy kernel windows causal rows only
        return None
    if seg is not None and not (seg.dtype == np.int32 and seg.flags.c_contiguous
                                and seg.shape == (B, T)):
        return None
    return B, H, KV, T, hd


def _ints(shape, attrs):
    return [*shape, attrs["layout"] == TOKEN_MAJOR, attrs["causal"], attrs["window"],
            attrs["save_lse"]]


def _sinks_fit(sinks, H) -> bool:
    return sinks is None or (f32_contiguous(sinks) and sinks.size == H)


@replays("attention")
def _attention(node, out, srcs, attrs):
    q, k, v, seg, sinks, _ = split_operands(srcs, "attention", attrs)
    shape = _shape(q, k, seg, attrs) if f32_contiguous(out, q, k, v) else None
    if shape is not None and _sinks_fit(sinks, shape[1]):
        return Call("attention", [out, q, k, v, seg, None, None, sinks], _ints(shape, attrs),
                    [attrs["scale"]])


@replays("attention_back")
def _attention_back(node, out, srcs, attrs):
    q, k, v, seg, sinks, (fwd, g) = split_operands(srcs, "attention_back", attrs)
    ok = f32_contiguous(out, q, k, v, fwd, g) and v.shape == k.shape
    shape = _shape(q, k, seg, attrs) if ok else None
    if shape is not None and _sinks_fit(sinks, shape[1]):
        return Call("attention_back", [out, q, k, v, seg, fwd, g, sinks], _ints(shape, attrs),
                    [attrs["scale"]])


#: The additive mask value at or below which a cache row is closed (kvcache.py's MASKED is
#: -1e30): cache_attention leaves such rows out (their weight is exactly 0 in numpy's).
CLOSED = -1e29


@fuses("matmul", "add", "softmax", "matmul")
def _cache_attention(nodes, outs, srcs):
    """Generation's decode attention, softmax(scale (q K^T + mask)) V over a KV cache
    (inference/kvcache.py CacheDecode.attention), as two kernels that read only the open
    rows (cpu.h: the scores where the first matmul runs, the values where the last does): q [R, KV, G, hd] against K [R, KV, L, hd] (trans_b), the mask [L] or
    [R, 1, 1, L], a non-causal softmax, then V [R, KV, L, hd]."""
    scores, masked, probs, o = nodes
    (q, kc), (_, mask), _, (_, vc) = srcs
    out = outs[3]
    if not (scores.attrs == {"trans_a": False, "trans_b": True}
            and o.attrs == {"trans_a": False, "trans_b": False}
            and not probs.attrs["causal"] and f32_contiguous(out, q, kc, vc, mask)
            and q.ndim == 4 and kc.shape == vc.shape and kc.ndim == 4):
        return None
    R, KV, G, hd = q.shape
    L = kc.shape[2]
    if kc.shape != (R, KV, L, hd) or out.shape != (R, KV, G, hd):
        return None
    if mask.shape == (L,):
        per_row = False
    elif mask.shape == (R, 1, 1, L):
        per_row = True
    else:
        return None
    mem = np.zeros(R * KV * G * L + R * (L + 1), np.float32)   # the two calls' own memory
    shape = [R, KV, G, L, hd]
    return [(0, Call("cache_scores", [mem, q, kc, mask], shape + [per_row], [probs.attrs["scale"]],
                     keep=[mem])),
            (3, Call("cache_values", [out, mem, vc], shape, keep=[mem]))]
