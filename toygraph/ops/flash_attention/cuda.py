"""The CUDA lowering of the flash_attention family (kernels in flash_attention.cu, tc_async.cuh,
tc_attention.cu, tc_matmul.cu; its ops and their rules are in __init__.py)."""
from __future__ import annotations

from toygraph.errors import CudaError
from toygraph.ops.flash_attention import TOKEN_MAJOR, attention_operands, heads_first
from toygraph.ops.flash_attention.cuda_tc import (TC_ATTENTION_PRECISION, tc_attention_launches,
                                                  tc_scratch)
from toygraph.ops.lowering import (MAX_GRID_YZ, Launch, declare_kernels, f32_arg, i32_arg, lowers,
                                   ptr_arg, rows_grid)
from toygraph.ops.lowering.constants import ATTN_TILES
from toygraph.precision import TENSOR_CORE_PRECISIONS

# The family's CUDA kernels, beside this module: the f32 kernels in every module; ldmatrix /
# cp.async (tc_async.cuh, usable by any tensor-core kernel) and the tensor-core attention
# only in the tensor-core precisions' modules, so the f32 module stays as it is.
declare_kernels(__file__, "flash_attention.cu")
declare_kernels(__file__, "tc_async.cuh", precisions=TENSOR_CORE_PRECISIONS)
declare_kernels(__file__, "tc_attention.cu", precisions=TENSOR_CORE_PRECISIONS,
                needs=("flash_attention.cu", "tc_matmul.cu", "tc_async.cuh"))


#: The f32 kernels of each head_dim bound HD (constants.ATTN_TILES; flash_attention.cu
#: instantiates each bound's): the forward, and the backward's D, dk/dv and dq.
ATTN_KERNELS = {
    32: {"fwd": "tg_attn_fwd_32", "prep": "tg_attn_bwd_prep_32", "dkdv": "tg_attn_bwd_dkdv_32",
         "dq": "tg_attn_bwd_dq_32"},
    64: {"fwd": "tg_attn_fwd_64", "prep": "tg_attn_bwd_prep_64", "dkdv": "tg_attn_bwd_dkdv_64",
         "dq": "tg_attn_bwd_dq_64"},
    128: {"fwd": "tg_attn_fwd_128", "prep": "tg_attn_bwd_prep_128",
          "dkdv": "tg_attn_bwd_dkdv_128", "dq": "tg_attn_bwd_dq_128"},
}


def attention_dims(node) -> tuple[int, int, int, int, int]:
    """(B, H, KV, T, hd) of an attention or attention_back node, whatever its layout."""
    B, H, T, hd = heads_first(node.srcs[0].shape, node.attrs["layout"])
    return B, H, heads_first(node.srcs[1].shape, node.attrs["layout"])[1], T, hd


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
        kernels=tuple(ks["fwd"] for ks in ATTN_KERNELS.values()))
@lowers("attention_back", scratch=_attention_scratch, bf16_reads=(0, 1, 2, -1),
        kernels=(*(ks[part] for part in ("prep", "dkdv", "dq") for ks in ATTN_KERNELS.values()),
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
        return [Launch(ATTN_KERNELS[HD]["fwd"], per_head,
                       [ptr_arg(out), ptr_arg(lse), ptr_arg(ptr(q)), ptr_arg(ptr(k)),
                        ptr_arg(ptr(v)), segs, sink, *common],
                       block)]
    g = rest[1]
    delta = at.scratch
    dq, dk, dv = out, out + 4 * q.size, out + 4 * (q.size + k.size)
    stats = [ptr_arg(lse), ptr_arg(delta), segs]
    qkvg = [ptr_arg(ptr(q)), ptr_arg(ptr(k)), ptr_arg(ptr(v)), ptr_arg(ptr(g))]
    launches = [Launch(ATTN_KERNELS[HD]["prep"], per_head,
                       [ptr_arg(delta), ptr_arg(packed), ptr_arg(ptr(g)), i32_arg(H), i32_arg(T),
                        i32_arg(hd), tok], block),
                Launch(ATTN_KERNELS[HD]["dkdv"], per_kv,
                       [ptr_arg(dk), ptr_arg(dv), *qkvg, *stats, *common], block),
                Launch(ATTN_KERNELS[HD]["dq"], per_head, [ptr_arg(dq), *qkvg, *stats,
                                                         *common], block)]
    if sinks is not None:
        dsinks = out + 4 * (q.size + 2 * k.size)
        launches.append(Launch("tg_attn_bwd_sinks", rows_grid(H),
                               [ptr_arg(dsinks), sink, ptr_arg(lse), ptr_arg(delta), i32_arg(B),
                                i32_arg(H), i32_arg(T)]))
    return launches
