"""The flash_attention family's engine replay (cpu.h beside this): attention and
attention_back on f32 operands of one sequence length, in either layout, with causal and
sliding-window masks and packed segments (sinks keep the numpy kernel)."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.flash_attention import TOKEN_MAJOR, heads_first, split_operands


def _shape(q, k, seg, attrs):
    """(B, H, KV, T, hd) when the kernel takes these operands, else None."""
    layout = attrs["layout"]
    (B, H, T, hd), (Bk, KV, Tk, hdk) = heads_first(q.shape, layout), heads_first(k.shape, layout)
    if (Bk, Tk, hdk) != (B, T, hd) or KV == 0 or H % KV or attrs.get("sinks"):
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


@replays("attention")
def _attention(node, out, srcs, attrs):
    q, k, v, seg, sinks, _ = split_operands(srcs, "attention", attrs)
    shape = _shape(q, k, seg, attrs) if f32_contiguous(out, q, k, v) and sinks is None else None
    if shape is not None:
        return Call("attention", [out, q, k, v, seg], _ints(shape, attrs), [attrs["scale"]])


@replays("attention_back")
def _attention_back(node, out, srcs, attrs):
    q, k, v, seg, sinks, (fwd, g) = split_operands(srcs, "attention_back", attrs)
    ok = f32_contiguous(out, q, k, v, fwd, g) and sinks is None and v.shape == k.shape
    shape = _shape(q, k, seg, attrs) if ok else None
    if shape is not None:
        return Call("attention_back", [out, q, k, v, seg, fwd, g], _ints(shape, attrs),
                    [attrs["scale"]])
