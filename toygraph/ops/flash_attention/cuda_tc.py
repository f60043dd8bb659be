"""The tensor-core attention's lowering (tc_attention.cu): what ``attention`` and
``attention_back`` launch when the backend's precision is "bf16" (flash_attention.py's
lowering hands them over; at "f32" and "tf32" the f32 kernels of flash_attention.cu run,
the exact path, so f32 results never change).

An operand the plan keeps in bf16 (cuda/bf16_storage.py: q and k from rope, v and dO from
products) that is token-major with hd equal to the kernels' bound HD is read as it lies
(bit j of the kernels' ``asis``: q, k, v, dO; :func:`reads_as_is`). Any other operand is
first copied to bf16 in scratch, heads first whatever the op's layout (a token-major
operand is read through its row stride by the copy itself; an f32 one rounded, a bf16
one copied), rows zero-padded from the head dim hd to HD (tg_tca_to_bf16). Either way the
kernels see the same bf16 values: rounding an f32 activation in the copy or when its
maker stores it in bf16 is the same rounding. ``attention`` then runs tg_tca_fwd_<HD>,
which writes o (in the operands' layout) and the row log-sum-exp L into the attention
node. ``attention_back`` reads that L: D = rowsum(dO o) and, unless dO is read as it lies,
dO as bf16 (tg_tca_bwd_prep), dk/dv and dq, and with sinks their gradient
(flash_attention.cu's tg_attn_bwd_sinks, from the same L and D).

Scratch (bytes, 16-byte aligned regions): q, k, v [and dO] as bf16 [rows, HD], then D f32
[B, H, T] for the backward.
"""
from __future__ import annotations

from toygraph.errors import CudaError
from toygraph.ops.lowering import (MAX_ELEMENTS, Launch, f32_arg, grid_1d, i32_arg, ptr_arg,
                                   rows_grid)
from toygraph.ops.lowering.constants import TCA_BQ, TCA_HEAD_DIMS, TCA_THREADS

#: The precision whose attention runs on tensor cores (tf32 keeps the f32 kernels).
TC_ATTENTION_PRECISION = "bf16"


#: The kernels of each head_dim bound HD (constants.TCA_TILES; tc_attention.cu instantiates
#: each bound's): the forward, and the backward's dk/dv and dq.
TCA_KERNELS = {
    64: {"fwd": "tg_tca_fwd_64", "dkdv": "tg_tca_bwd_dkdv_64", "dq": "tg_tca_bwd_dq_64"},
    128: {"fwd": "tg_tca_fwd_128", "dkdv": "tg_tca_bwd_dkdv_128", "dq": "tg_tca_bwd_dq_128"},
    256: {"fwd": "tg_tca_fwd_256", "dkdv": "tg_tca_bwd_dkdv_256", "dq": "tg_tca_bwd_dq_256"},
}


def tc_head_dim(hd: int) -> int:
    """The smallest kernel bound HD >= head_dim ``hd``."""
    for HD in TCA_HEAD_DIMS:
        if hd <= HD:
            return HD
    raise CudaError(f"attention: head_dim {hd} exceeds the tensor-core kernels' maximum "
                    f"{max(TCA_HEAD_DIMS)}")


def tc_scratch(node, dims) -> int:
    """Bytes of scratch: bf16 q, k, v (and dO) copies, and D for the backward; ``dims``
    the node's (B, H, KV, T, hd)."""
    B, H, KV, T, hd = dims
    q_rows, kv_rows, HD = B * H * T, B * KV * T, tc_head_dim(hd)
    if node.op == "attention":
        return 2 * HD * (q_rows + 2 * kv_rows)
    return 2 * HD * (2 * q_rows + 2 * kv_rows) + 4 * q_rows


def reads_as_is(at, x, token_major: bool, hd: int) -> bool:
    """Whether the kernels read operand ``x`` where it lies: kept in bf16, token-major rows
    of exactly HD elements (no padding to add). Otherwise they read a copy."""
    return at.half(x) and token_major and hd == tc_head_dim(hd)


def _to_bf16(dst: int, src: int, rows: int, hd: int, HD: int, heads_t: list,
             src_bf16: bool) -> Launch:
    if rows * HD > MAX_ELEMENTS:
        raise CudaError(f"attention: {rows} x {HD} operand elements exceed the kernels' int "
                        f"indexing ({MAX_ELEMENTS})")
    return Launch("tg_tca_to_bf16", grid_1d(rows * HD), [ptr_arg(dst), ptr_arg(src), i32_arg(rows),
                                                         i32_arg(hd), i32_arg(HD), *heads_t,
                                                         i32_arg(src_bf16)])


def tc_attention_launches(node, at, dims, token_major: bool, lse: int,
                          operands) -> list[Launch]:
    """The launches of an attention / attention_back node at "bf16": ``dims`` its (B, H, KV,
    T, hd), ``token_major`` its layout, ``lse`` the address of L in the attention node (0:
    not saved), ``operands`` as flash_attention.attention_operands splits them."""
    q, k, v, seg, sinks, rest = operands
    B, H, KV, T, hd = dims
    q_rows, kv_rows, HD = B * H * T, B * KV * T, tc_head_dim(hd)
    tok = i32_arg(token_major)
    qb = at.scratch
    kb = qb + 2 * HD * q_rows
    vb = kb + 2 * HD * kv_rows
    segs = ptr_arg(at.ptr(seg) if seg is not None else 0)
    sink = ptr_arg(at.ptr(sinks) if sinks is not None else 0)
    common = [i32_arg(H), i32_arg(KV), i32_arg(T), i32_arg(hd), f32_arg(node.attrs["scale"]),
              i32_arg(node.attrs["causal"]), i32_arg(node.attrs["window"]), tok]
    tiles = (T + TCA_BQ - 1) // TCA_BQ
    block = (TCA_THREADS, 1, 1)
    q_heads, kv_heads = [i32_arg(H), i32_arg(T), tok], [i32_arg(KV), i32_arg(T), tok]
    launches, read, asis = [], [], 0
    for j, (x, copy, rows, heads_t) in enumerate(((q, qb, q_rows, q_heads),
                                                  (k, kb, kv_rows, kv_heads),
                                                  (v, vb, kv_rows, kv_heads))):
        if reads_as_is(at, x, token_major, hd):
            asis |= 1 << j
            read.append(ptr_arg(at.ptr(x)))
        else:
            launches.append(_to_bf16(copy, at.ptr(x), rows, hd, HD, heads_t, at.half(x)))
            read.append(ptr_arg(copy))
    if node.op == "attention":
        return launches + [Launch(TCA_KERNELS[HD]["fwd"], (tiles, H, B),
                                  [ptr_arg(at.out), ptr_arg(lse), *read, segs, sink, *common,
                                   i32_arg(asis)],
                                  block)]
    fwd, g = rest   # o is the attention node's first q.size elements, L follows
    gb = vb + 2 * HD * kv_rows
    delta = gb + 2 * HD * q_rows
    if reads_as_is(at, g, token_major, hd):
        asis |= 8
        g_read, gb = at.ptr(g), 0     # tg_tca_bwd_prep then only sums D
    else:
        g_read = gb
    dq, dk, dv = at.out, at.out + 4 * q.size, at.out + 4 * (q.size + k.size)
    operands = [*read, ptr_arg(g_read), ptr_arg(lse), ptr_arg(delta), segs, *common, i32_arg(asis)]
    launches += [
        Launch("tg_tca_bwd_prep", grid_1d(q_rows), [ptr_arg(gb), ptr_arg(delta),
                                                    ptr_arg(at.ptr(fwd)), ptr_arg(at.ptr(g)),
                                                    i32_arg(q_rows), i32_arg(hd), i32_arg(HD),
                                                    *q_heads, i32_arg(2 * at.half(g))]),
        Launch(TCA_KERNELS[HD]["dkdv"], (tiles, KV, B), [ptr_arg(dk), ptr_arg(dv),
                                                        *operands], block),
        Launch(TCA_KERNELS[HD]["dq"], (tiles, H, B), [ptr_arg(dq), *operands], block)]
    if sinks is not None:
        dsinks = at.out + 4 * (q.size + 2 * k.size)
        launches.append(Launch("tg_attn_bwd_sinks", rows_grid(H),
                               [ptr_arg(dsinks), sink, ptr_arg(lse), ptr_arg(delta), i32_arg(B),
                                i32_arg(H), i32_arg(T)]))
    return launches
