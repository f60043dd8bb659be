"""Lowering of the fused ops: flash-style causal (optionally sliding-window) attention
(attention.cu) and the output head + cross-entropy over row chunks (lce.cu)."""
from __future__ import annotations

from ..errors import CudaError
from ..ops_fused import attention_operands
from .constants import ATTN_TILES, MM_BM, MM_THREADS, TC_THREADS
from .kernels import QUANT_KERNELS, TC_KERNELS
from .launch import MAX_GRID_YZ, Launch, _blocks, _rows_grid, f32, i32, p, strided
from .lower_matmul import TC_TILE, row_bytes
from .registry import lowers


def attention_config(hd: int) -> tuple[int, int, int]:
    """(HD, BT, TPR) of the kernels that run head_dim ``hd``: the smallest HD >= hd."""
    for HD in sorted(ATTN_TILES):
        if hd <= HD:
            return (HD, *ATTN_TILES[HD])
    raise CudaError(f"attention: head_dim {hd} exceeds the kernels' maximum {max(ATTN_TILES)}")


def _attention_scratch(node) -> int:
    """attention_back: row log-sum-exp and rowsum(dO * O), [B, H, T] each."""
    return 2 * 4 * node.srcs[0].size // node.srcs[0].shape[-1]


@lowers("attention", kernels=("tg_attn_fwd_32", "tg_attn_fwd_64", "tg_attn_fwd_128"))
@lowers("attention_back", scratch=_attention_scratch,
        kernels=("tg_attn_bwd_prep_32", "tg_attn_bwd_prep_64", "tg_attn_bwd_prep_128",
                 "tg_attn_bwd_dkdv_32", "tg_attn_bwd_dkdv_64", "tg_attn_bwd_dkdv_128",
                 "tg_attn_bwd_dq_32", "tg_attn_bwd_dq_64", "tg_attn_bwd_dq_128"))
def _attention(node, at) -> list[Launch]:
    """attention: one launch, a block per (query tile, head, batch). attention_back: the
    row statistics into scratch, then dk/dv per (key tile, kv head, batch) and dq per
    (query tile, head, batch), written straight into the packed [dq, dk, dv] output. The
    kernels are instantiated per head_dim bound HD (constants.ATTN_TILES), named ``_HD``.
    Optional segment ids (sample packing) pass as a pointer after the float operands, a
    null pointer without them."""
    out, ptr, scratch = at.out, at.ptr, at.scratch
    q, k, v, seg, rest = attention_operands(node)
    segs = p(ptr(seg) if seg is not None else 0)
    B, H, T, hd = q.shape
    KV = k.shape[1]
    HD, BT, TPR = attention_config(hd)
    if max(H, B) > MAX_GRID_YZ:
        raise CudaError(f"attention {node.name!r}: {B} x {H} exceeds the grid limit")
    tiles = (T + BT - 1) // BT
    common = [i32(H), i32(KV), i32(T), i32(hd), f32(node.attrs["scale"]),
              i32(node.attrs["causal"]), i32(node.attrs["window"])]
    block = (BT * TPR, 1, 1)
    per_head, per_kv = (tiles, H, B), (tiles, KV, B)
    if node.op == "attention":
        return [Launch(f"tg_attn_fwd_{HD}", per_head,
                       [p(out), p(ptr(q)), p(ptr(k)), p(ptr(v)), segs, *common], block)]
    o, g = rest
    lse, delta = scratch, scratch + 4 * B * H * T
    dq, dk, dv = out, out + 4 * q.size, out + 4 * (q.size + k.size)
    stats = [p(lse), p(delta), segs]
    qkvg = [p(ptr(q)), p(ptr(k)), p(ptr(v)), p(ptr(g))]
    return [Launch(f"tg_attn_bwd_prep_{HD}", per_head,
                   [p(lse), p(delta), p(ptr(q)), p(ptr(k)), p(ptr(o)), p(ptr(g)), segs, *common],
                   block),
            Launch(f"tg_attn_bwd_dkdv_{HD}", per_kv, [p(dk), p(dv), *qkvg, *stats, *common],
                   block),
            Launch(f"tg_attn_bwd_dq_{HD}", per_head, [p(dq), *qkvg, *stats, *common], block)]


# --- fused output head + cross-entropy --------------------------------------------------------
#: Bytes of the [rows, vocab] f32 logits block one chunk of linear_cross_entropy uses (its
#: only vocabulary-sized buffer). 256 MiB is 1344 rows of SmolLM2's 49152-token vocabulary:
#: enough rows that dh = dlogits @ W (K = vocab, N = n_embd) still fills the GPU.
LCE_CHUNK_BYTES = 256 << 20


def lce_chunk_rows(n_rows: int, vocab: int) -> int:
    """Rows per chunk: as many as LCE_CHUNK_BYTES holds, a multiple of the MM_BM-row matmul
    tile when that is at least one tile, never more than the rows there are."""
    rows = LCE_CHUNK_BYTES // (4 * vocab)
    if rows >= MM_BM:
        rows = rows // MM_BM * MM_BM
    return max(1, min(n_rows, rows))


def _lce_scratch(node) -> dict[str, int]:
    """Scratch parts, in order, in bytes (each 256-byte aligned): the chunk's logits block,
    then forward the per-row losses [N], backward the dlogits weight (one f32)."""
    (N, _), V = node.srcs[0].shape, node.srcs[1].shape[0]
    parts = {"logits": 4 * lce_chunk_rows(N, V) * V}
    parts["rowloss" if node.op == "linear_cross_entropy" else "gscale"] = (
        4 * N if node.op == "linear_cross_entropy" else 4)
    return {k: (v + 255) // 256 * 256 for k, v in parts.items()}


def _dense_mm(out, a, b, M, N, K, sam, sak, sbk, sbn, precision, kernel="tg_matmul") -> Launch:
    """One unbatched matmul launch, A(m, k) = a[m*sam + k*sak], B(k, n) = b[k*sbk + n*sbn];
    tensor-core kernels (same arguments) for ``precision`` bf16/tf32 unless ``kernel`` is
    tg_matmul_acc, which has no tensor-core twin."""
    tile, block = MM_BM, (MM_THREADS, 1, 1)
    if precision != "f32" and kernel == "tg_matmul":
        kernel, tile, block = TC_KERNELS[precision]["matmul"], TC_TILE, (TC_THREADS, 1, 1)
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{kernel}: {M} rows exceed the kernel's grid limit")
    return Launch(kernel, ((N + tile - 1) // tile, gy, 1),
                  [p(out), p(a), p(b), i32(M), i32(N), i32(K), i32(sam), i32(sak), i32(sbk),
                   i32(sbn), i32(1), strided([], [])], block)


def _q_mm(out, a, w, w_ptr, M, N, K, kind, precision) -> Launch:
    """x @ W^T ("nt") or dy @ W ("nn") with the block-format const ``w`` at ``w_ptr``, with
    _qmatmul's arguments (tensor-core twins for bf16/tf32, as _tc_matmul picks them)."""
    kernel, tile, threads = QUANT_KERNELS[w.storage][kind], MM_BM, MM_THREADS
    if precision != "f32":
        kernel, tile, threads = TC_KERNELS[precision][kind][w.storage], TC_TILE, TC_THREADS
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{kernel}: {M} rows exceed the kernel's grid limit")
    return Launch(kernel, (max(1, (N + tile - 1) // tile), max(1, gy), 1),
                  [p(out), p(a), p(w_ptr), i32(M), i32(N), i32(K), i32(row_bytes(w))],
                  block=(threads, 1, 1))


def _head_in_blocks(node, index: int) -> bool:
    """The head as the weight of logits = h W^T and dh = dlogits W; a frozen const has no
    dw, the one product that would read W another way."""
    return index == 1 and node.srcs[0] is not node.srcs[1] and not node.attrs.get("grad_w")


def _lce_scratch_bytes(node) -> int:
    return sum(_lce_scratch(node).values())


@lowers("linear_cross_entropy", kernels=("tg_matmul", "tg_ce_rows", "tg_ce_reduce"),
        scratch=_lce_scratch_bytes, block_format=_head_in_blocks)
@lowers("linear_cross_entropy_back", scratch=_lce_scratch_bytes, block_format=_head_in_blocks,
        kernels=("tg_lce_grad_scale", "tg_fill", "tg_matmul", "tg_ce_back", "tg_matmul_acc"))
def _linear_cross_entropy(node, at) -> list[Launch]:
    """Launches over chunks of ``rows`` rows sharing one [rows, V] logits block in scratch.

    forward:  per chunk  logits = h_c W^T;  tg_ce_rows -> rowloss[c]
              then       tg_ce_reduce(rowloss, all labels) -> the loss
    backward: tg_lce_grad_scale -> gs (g, or g / n for mean); tg_fill dw = 0 if dw is asked
              per chunk  logits = h_c W^T;  tg_ce_back in place -> dlogits_c (weight gs)
                         dh_c = dlogits_c W          (into dh's rows of the chunk)
                         dw += dlogits_c^T h_c       (tg_matmul_acc; chunk order fixed)
    A block-format head reads through the QUANT_KERNELS "nt"/"nn" kernels instead of
    tg_matmul, and bf16/tf32 through their tensor-core twins.
    """
    out, ptr, scratch = at.out, at.ptr, at.scratch
    raw_consts, precision = at.raw_consts, at.precision
    h, w, labels = node.srcs[:3]
    (N, D), V = h.shape, w.shape[0]
    rows = lce_chunk_rows(N, V)
    parts = _lce_scratch(node)
    zbuf = scratch
    extra = scratch + parts["logits"]
    hp, lp = ptr(h), ptr(labels)
    quant = w.id in raw_consts
    fwd = node.op == "linear_cross_entropy"
    grad_h = not fwd and node.attrs["grad_h"]
    grad_w = not fwd and node.attrs["grad_w"]
    if grad_w and quant:
        raise CudaError(f"{node.op} {node.name!r}: no dw for the block-format const {w.name!r}")
    dh, dw = out, out + 4 * N * D * grad_h
    launches = []
    if not fwd:
        launches.append(Launch("tg_lce_grad_scale", (1, 1, 1),
                               [p(extra), p(lp), i32(N), p(ptr(node.srcs[3])),
                                i32(node.attrs["reduction"] == "mean")]))
        if grad_w:
            launches.append(Launch("tg_fill", _blocks(V * D), [p(dw), i32(V * D), f32(0.0)]))
    for r0 in range(0, N, rows):
        c = min(rows, N - r0)
        hc, lc = hp + 4 * r0 * D, lp + 4 * r0
        if quant:   # logits = h_c W^T: A = h_c [c, D], W [V, D]
            launches.append(_q_mm(zbuf, hc, w, ptr(w), c, V, D, "nt", precision))
        else:
            launches.append(_dense_mm(zbuf, hc, ptr(w), c, V, D, D, 1, 1, D, precision))
        if fwd:
            launches.append(Launch("tg_ce_rows", _rows_grid(c),
                                   [p(extra + 4 * r0), p(zbuf), p(lc), i32(c), i32(V)]))
            continue
        launches.append(Launch("tg_ce_back", _rows_grid(c),
                               [p(zbuf), p(zbuf), p(lc), p(extra), i32(c), i32(V), i32(0)]))
        if grad_h:   # dh_c = dlogits_c [c, V] @ W [V, D]
            if quant:
                launches.append(_q_mm(dh + 4 * r0 * D, zbuf, w, ptr(w), c, D, V, "nn",
                                            precision))
            else:
                launches.append(_dense_mm(dh + 4 * r0 * D, zbuf, ptr(w), c, D, V, V, 1, D, 1,
                                          precision))
        if grad_w:   # dw [V, D] += dlogits_c^T [V, c] @ h_c [c, D]
            launches.append(_dense_mm(dw, zbuf, hc, V, D, c, 1, V, D, 1, precision,
                                      kernel="tg_matmul_acc"))
    if fwd:
        launches.append(Launch("tg_ce_reduce", (1, 1, 1),
                               [p(out), p(extra), p(lp), i32(N),
                                i32(node.attrs["reduction"] == "mean")]))
    return launches
