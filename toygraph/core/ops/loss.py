"""The loss ops: cross_entropy over integer labels (-1 ignored) with its backward op,
count_valid (the number of labelled positions), and linear_cross_entropy, the output head
fused with the loss so no [N, vocab] logits exist. Builders, shape rules, backward rules,
numpy kernels (row chunks) and CUDA lowering (loss.cu, plus the matmul kernels the fused
head runs per chunk of rows).
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.gemm import (BF16_GEMM_PRECISION, block_mm, dense_mm, engine_multiplies,
                                   row_bytes)
from toygraph.core.ops.tc_gemm import K_ALIGN, Gemm, bf16_copy, deq_launch, gemm_launches
from toygraph.core.ops.shape import unpack
from toygraph.core.ops.table import (F32, I32, INT32_MAX, LABELS, block_kernel, check, define_op,
                                     kernel, make_node)
from toygraph.cuda.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                    ptr_arg, rows_grid)
from toygraph.cuda.lowering.constants import MM_BM
from toygraph.errors import CudaError, GraphError

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "loss.cu")


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

    A head whose model soft-caps its logits (models/decoder.py marks it, Gemma 4) is refused:
    the fused kernels have no soft cap, so the loss would be another model's.
    """
    cap = w.attrs.get("logit_softcap") if w.op is None else None
    if cap:
        raise GraphError(f"linear_cross_entropy: the head {w.name!r} belongs to a model whose logits are "
                         f"soft-capped at {cap}; the fused head has no soft cap (use lm_head + cross_entropy)")
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


# --- numpy kernels -----------------------------------------------------------------------------
_CE_ROWS = 64  # rows per chunk: keeps the exp temporaries in cache, not [N, vocab]


@kernel("cross_entropy")
def _cross_entropy_numpy(out, srcs, attrs):
    logits, labels = srcs
    valid = labels >= 0
    rows = np.nonzero(valid)[0]
    total = 0.0
    buf = np.empty((min(_CE_ROWS, max(len(rows), 1)), logits.shape[1]), logits.dtype)
    for start in range(0, len(rows), _CE_ROWS):
        r = rows[start:start + _CE_ROWS]
        z = buf[:len(r)]
        np.take(logits, r, axis=0, out=z)
        m = z.max(axis=1, keepdims=True)
        picked = z[np.arange(len(r)), labels[r]] - m[:, 0]
        z -= m
        np.exp(z, out=z)
        total += float(np.sum(np.log(z.sum(axis=1)) - picked, dtype=np.float64))
    n = len(rows)
    out[...] = total if attrs["reduction"] == "sum" else (total / n if n else 0.0)


@kernel("cross_entropy_back")
def _cross_entropy_back_numpy(out, srcs, attrs):
    logits, labels, g = srcs
    valid = labels >= 0
    n = int(valid.sum())
    m = logits.max(axis=-1, keepdims=True)
    np.subtract(logits, m, out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    rows = np.nonzero(valid)[0]
    out[rows, labels[rows]] -= 1.0
    w = g if attrs["reduction"] == "sum" else (g / n if n else 0.0 * g)
    out *= (valid[:, None] * w).astype(out.dtype)


@kernel("count_valid")
def _count_valid_numpy(out, srcs, attrs):
    out[...] = np.count_nonzero(srcs[0] >= 0)


# Rows of the fused head + loss per chunk: a [rows, vocab] block of logits at a time (25 MB
# for SmolLM2's 49152-token vocabulary at 128 rows, f32) instead of [N, vocab]; fewer rows
# make the BLAS calls slower (SmolLM2 head, 512 rows: 0.73 s at 64, 0.63 s at 128).
LCE_ROWS = 128


def _head_rows(hc, w, z):
    """z = hc @ w^T: BLAS on an f32 head, the CPU engine on one kept in its blocks (a
    cpu.block_tensor.BlockTensor: each chunk's product decodes the head panel by panel)."""
    if isinstance(w, np.ndarray):
        np.matmul(hc, w.T, out=z)
    else:
        w.matmul_nt(hc, z)


def _lce_chunks(h, w, labels):
    """Per chunk of the rows whose label is not ignored: (row ids, h rows, exp(z - max) in
    a reused buffer, its row sums, the row max, the label's logit) with z = h_rows @ w^T."""
    rows = np.flatnonzero(labels >= 0)
    if not len(rows):
        return
    n = min(LCE_ROWS, len(rows))
    hbuf = np.empty((n, h.shape[1]), h.dtype)
    zbuf = np.empty((n, w.shape[0]), h.dtype)
    for start in range(0, len(rows), LCE_ROWS):
        r = rows[start:start + LCE_ROWS]
        c = len(r)
        hc, z = hbuf[:c], zbuf[:c]
        np.take(h, r, axis=0, out=hc)
        _head_rows(hc, w, z)
        m = z.max(axis=1, keepdims=True)
        picked = z[np.arange(c), labels[r]]
        z -= m
        np.exp(z, out=z)
        yield r, hc, z, z.sum(axis=1), m[:, 0], picked


@block_kernel("linear_cross_entropy", reads=(1,), when=lambda node, itemsize: engine_multiplies(
    node.srcs[1], itemsize))
@kernel("linear_cross_entropy")
def _linear_cross_entropy_numpy(out, srcs, attrs, scratch=None):
    h, w, labels = srcs
    total, n = 0.0, 0
    if attrs["reduction"] == "none":
        out.fill(0)
    for r, _, _, s, m, picked in _lce_chunks(h, w, labels):
        row_loss = np.log(s) + m - picked
        if attrs["reduction"] == "none":
            out[r] = row_loss
        total += float(np.sum(row_loss, dtype=np.float64))
        n += len(r)
    if attrs["reduction"] != "none":
        out[...] = total if attrs["reduction"] == "sum" else (total / n if n else 0.0)


@block_kernel("linear_cross_entropy_back", reads=(1,),
              when=lambda node, itemsize: not node.attrs["grad_w"] and engine_multiplies(
                  node.srcs[1], itemsize))
@kernel("linear_cross_entropy_back")
def _linear_cross_entropy_back_numpy(out, srcs, attrs, scratch=None):
    """[dh, dw] packed flat (each only when asked), chunk by chunk from the recomputed
    softmax: dz = (softmax(z) - onehot) * g (/ n for mean), dh = dz @ w, dw += dz^T h, the
    chunks added into dw in row order. For ``none`` the weight is g's entry of each row.
    A frozen head kept in its blocks (the block kernel: no dw) is read by the CPU engine."""
    h, w, labels, g = srcs
    (N, D), V = h.shape, w.shape[0]
    dh = out[:N * D].reshape(N, D) if attrs["grad_h"] else None
    dw = out[N * D * attrs["grad_h"]:].reshape(V, D) if attrs["grad_w"] else None
    out.fill(0)
    n = int(np.count_nonzero(labels >= 0))
    per_row = attrs["reduction"] == "none"
    scale = g if attrs["reduction"] != "mean" else (g / n if n else 0.0 * g)
    scale = scale.astype(out.dtype) if per_row else out.dtype.type(scale)
    tmp = None
    for r, hc, z, s, _, _ in _lce_chunks(h, w, labels):
        z /= s[:, None]
        z[np.arange(len(r)), labels[r]] -= 1.0
        z *= scale[r, None] if per_row else scale
        if dh is not None:
            dh[r] = z @ w if isinstance(w, np.ndarray) else w.matmul_nn(z, np.empty((len(r), D), z.dtype))
        if dw is not None:
            if tmp is None:
                tmp = np.empty_like(dw)
            np.matmul(z.T, hc, out=tmp)
            dw += tmp


# --- CUDA lowering (loss.cu) -------------------------------------------------------------------
def _ce_scratch(node) -> int:
    """One f32 loss per row."""
    return 4 * node.srcs[0].shape[0]


@lowers("cross_entropy", kernels=("tg_ce_rows", "tg_ce_reduce"), scratch=_ce_scratch)
def _cross_entropy(node, at):
    """Per-row losses into scratch, then one block sums (or averages) them in order."""
    logits, labels = node.srcs
    N, V = logits.shape
    mean = i32_arg(node.attrs["reduction"] == "mean")
    return [Launch("tg_ce_rows", rows_grid(N), [ptr_arg(at.scratch), ptr_arg(at.ptr(logits)),
                                                 ptr_arg(at.ptr(labels)), i32_arg(N), i32_arg(V)]),
            Launch("tg_ce_reduce", (1, 1, 1),
                   [ptr_arg(at.out), ptr_arg(at.scratch), ptr_arg(at.ptr(labels)), i32_arg(N),
                    mean])]


@lowers("cross_entropy_back", kernels=("tg_ce_back",))
def _cross_entropy_back(node, at):
    logits, labels, g = node.srcs
    N, V = logits.shape
    return [Launch("tg_ce_back", rows_grid(N),
                   [ptr_arg(at.out), ptr_arg(at.ptr(logits)), ptr_arg(at.ptr(labels)),
                    ptr_arg(at.ptr(g)), i32_arg(N), i32_arg(V),
                    i32_arg(node.attrs["reduction"] == "mean")])]


@lowers("count_valid", kernels=("tg_count_valid",))
def _count_valid(node, at):
    labels = node.srcs[0]
    return [Launch("tg_count_valid", (1, 1, 1), [ptr_arg(at.out), ptr_arg(at.ptr(labels)),
                                                 i32_arg(labels.size)])]


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


def _padded(n: int) -> int:
    return -(-n // K_ALIGN) * K_ALIGN


def _head_gemms(node, rows: int) -> tuple[Gemm, Gemm]:
    """At bf16, a chunk's two products on the bf16 copies of W the node makes once:
    logits_c = h_c [rows, D] W^T, B from W as it is ([V][D'], "w_nt"); dh_c = dlogits_c
    [rows, V] W, B from W's transpose ([D][V'], "w_nn"); D', V' rounded up to 8."""
    (_, D), V = node.srcs[0].shape, node.srcs[1].shape[0]
    return (Gemm(rows, V, D, D, 1, 1, _padded(D)), Gemm(rows, D, V, V, 1, 1, _padded(V)))


def _lce_scratch(node, precision: str = "f32") -> dict[str, int]:
    """Scratch parts, in order, in bytes (each 256-byte aligned): the chunk's logits block,
    then forward the per-row losses [N], backward the dlogits weight (one f32); reduction
    "none" needs neither (its rows go straight to the output, its weights are g's rows).
    At bf16 the head's bf16 copies (W and, for dh, its transpose: decoded once per node
    from a block-format head, copied from an f32 one) and the chunk GEMMs' own copies and
    split partials (room for the last, shorter chunk's too)."""
    (N, D), V = node.srcs[0].shape, node.srcs[1].shape[0]
    rows = lce_chunk_rows(N, V)
    parts = {"logits": 4 * rows * V}
    if node.attrs["reduction"] != "none" and node.op == "linear_cross_entropy":
        parts["rowloss"] = 4 * N
    elif node.attrs["reduction"] != "none":
        parts["gscale"] = 4
    if precision == BF16_GEMM_PRECISION:
        dh = node.op == "linear_cross_entropy_back" and node.attrs["grad_h"]
        parts["w_nt"] = 2 * V * _padded(D)
        if dh:
            parts["w_nn"] = 2 * D * _padded(V)
        parts["gemm"] = max(g.scratch() for r in (rows, N % rows or rows)
                            for g in _head_gemms(node, r)[:1 + dh])
    return {k: (v + 255) // 256 * 256 for k, v in parts.items()}


def _part(at, parts: dict, name: str) -> int:
    """The address of scratch part ``name`` (parts in order, as _lce_scratch lists them)."""
    offset = 0
    for key, size in parts.items():
        if key == name:
            return at.scratch + offset
        offset += size
    raise KeyError(name)


def _head_copies(node, at, parts: dict, grad_h: bool) -> list[Launch]:
    """At bf16, W [V, D] once as the logits GEMM's B ([V][D']) and, for dh, its transpose
    ([D][V']): decoded from a block-format head (tg_tcg_deq_*), else copied from f32."""
    w, what = node.srcs[1], f"{node.op} {node.name!r}"
    V, D = w.shape
    dp, vp = _padded(D), _padded(V)
    nt, nn = _part(at, parts, "w_nt"), grad_h and _part(at, parts, "w_nn")
    if w.id in at.raw_consts:
        rb = row_bytes(w)
        return ([deq_launch(w.storage, "nt", nt, at.ptr(w), V, D, dp, rb)]
                + ([deq_launch(w.storage, "nn", nn, at.ptr(w), D, V, vp, rb)] if grad_h else []))
    return (bf16_copy(nt, at.ptr(w), V, D, dp, D, 1, what)
            + (bf16_copy(nn, at.ptr(w), D, V, vp, 1, D, what) if grad_h else []))


def _head_in_blocks(node, index: int) -> bool:
    """The head as the weight of logits = h W^T and dh = dlogits W; a frozen const has no
    dw, the one product that would read W another way."""
    return index == 1 and node.srcs[0] is not node.srcs[1] and not node.attrs.get("grad_w")


def _lce_scratch_bytes(node, precision: str) -> int:
    return sum(_lce_scratch(node, precision).values())


# One function for both ops (77 lines): forward and backward share the chunk walk and the
# logits matmul of every chunk; split, each half would restate them.
@lowers("linear_cross_entropy", kernels=("tg_matmul", "tg_ce_rows", "tg_ce_reduce"),
        scratch=_lce_scratch_bytes, block_format=_head_in_blocks)
@lowers("linear_cross_entropy_back", scratch=_lce_scratch_bytes, block_format=_head_in_blocks,
        kernels=("tg_lce_grad_scale", "tg_fill", "tg_matmul", "tg_ce_back", "tg_ce_back_rows",
                 "tg_matmul_acc"))
def _linear_cross_entropy(node, at) -> list[Launch]:
    """Launches over chunks of ``rows`` rows sharing one [rows, V] logits block in scratch.

    forward:  per chunk  logits = h_c W^T;  tg_ce_rows -> rowloss[c]
              then       tg_ce_reduce(rowloss, all labels) -> the loss
    backward: tg_lce_grad_scale -> gs (g, or g / n for mean); tg_fill dw = 0 if dw is asked
              per chunk  logits = h_c W^T;  tg_ce_back in place -> dlogits_c (weight gs)
                         dh_c = dlogits_c W          (into dh's rows of the chunk)
                         dw += dlogits_c^T h_c       (tg_matmul_acc; chunk order fixed)
    Reduction "none": forward tg_ce_rows writes the output's rows and nothing reduces;
    backward has no tg_lce_grad_scale and tg_ce_back_rows weighs each row by its g.
    A block-format head reads through the QUANT_KERNELS "nt"/"nn" kernels instead of
    tg_matmul, and tf32 through their tensor-core twins. At bf16 both products run
    tc_gemm.cu's GEMM on bf16 copies of W the node makes once (decoded from its blocks, or
    copied from f32: _head_copies) instead of decoding W per element in every chunk, dh
    with split-K (k = V) where its tiles are few; copies and partials in scratch.
    """
    out, ptr, scratch = at.out, at.ptr, at.scratch
    raw_consts, precision = at.raw_consts, at.precision
    h, w, labels = node.srcs[:3]
    (N, D), V = h.shape, w.shape[0]
    rows = lce_chunk_rows(N, V)
    parts = _lce_scratch(node, precision)
    zbuf = scratch
    extra = scratch + parts["logits"]
    hp, lp = ptr(h), ptr(labels)
    quant = w.id in raw_consts
    fwd = node.op == "linear_cross_entropy"
    per_row = node.attrs["reduction"] == "none"
    grad_h = not fwd and node.attrs["grad_h"]
    grad_w = not fwd and node.attrs["grad_w"]
    if grad_w and quant:
        raise CudaError(f"{node.op} {node.name!r}: no dw for the block-format const {w.name!r}")
    dh, dw = out, out + 4 * N * D * grad_h
    launches = []
    if not fwd and not per_row:
        launches.append(Launch("tg_lce_grad_scale", (1, 1, 1),
                               [ptr_arg(extra), ptr_arg(lp), i32_arg(N),
                                ptr_arg(ptr(node.srcs[3])),
                                i32_arg(node.attrs["reduction"] == "mean")]))
    if grad_w:
        launches.append(Launch("tg_fill", grid_1d(V * D), [ptr_arg(dw), i32_arg(V * D),
                                                           f32_arg(0.0)]))
    tc = precision == BF16_GEMM_PRECISION
    if tc:
        launches += _head_copies(node, at, parts, grad_h)
    what = f"{node.op} {node.name!r}"
    for r0 in range(0, N, rows):
        c = min(rows, N - r0)
        hc, lc = hp + 4 * r0 * D, lp + 4 * r0
        if tc:      # logits = h_c W^T on W's bf16 copy
            launches += gemm_launches(_head_gemms(node, c)[0], zbuf, hc, _part(at, parts, "w_nt"),
                                      _part(at, parts, "gemm"), what, b_bf16=True)
        elif quant:   # logits = h_c W^T: A = h_c [c, D], W [V, D]
            launches.append(block_mm(zbuf, hc, w, ptr(w), c, V, D, "nt", precision))
        else:
            launches.append(dense_mm(zbuf, hc, ptr(w), c, V, D, D, 1, 1, D, precision))
        if fwd:
            launches.append(Launch("tg_ce_rows", rows_grid(c), [ptr_arg((out if per_row else extra)
                                   + 4 * r0), ptr_arg(zbuf), ptr_arg(lc), i32_arg(c), i32_arg(V)]))
            continue
        if per_row:
            launches.append(Launch("tg_ce_back_rows", rows_grid(c),
                                   [ptr_arg(zbuf), ptr_arg(zbuf), ptr_arg(lc),
                                    ptr_arg(ptr(node.srcs[3]) + 4 * r0), i32_arg(c), i32_arg(V)]))
        else:
            launches.append(Launch("tg_ce_back", rows_grid(c),
                                   [ptr_arg(zbuf), ptr_arg(zbuf), ptr_arg(lc), ptr_arg(extra),
                                    i32_arg(c), i32_arg(V), i32_arg(0)]))
        if grad_h:   # dh_c = dlogits_c [c, V] @ W [V, D]
            if tc:   # on W's transposed bf16 copy (split over the vocabulary when few tiles)
                launches += gemm_launches(_head_gemms(node, c)[1], dh + 4 * r0 * D, zbuf,
                                          _part(at, parts, "w_nn"), _part(at, parts, "gemm"),
                                          what, b_bf16=True)
            elif quant:
                launches.append(block_mm(dh + 4 * r0 * D, zbuf, w, ptr(w), c, D, V, "nn",
                                         precision))
            else:
                launches.append(dense_mm(dh + 4 * r0 * D, zbuf, ptr(w), c, D, V, V, 1, D, 1,
                                         precision))
        if grad_w:   # dw [V, D] += dlogits_c^T [V, c] @ h_c [c, D]
            launches.append(dense_mm(dw, zbuf, hc, V, D, c, 1, V, D, 1, precision,
                                     kernel="tg_matmul_acc"))
    if fwd and not per_row:
        launches.append(Launch("tg_ce_reduce", (1, 1, 1),
                               [ptr_arg(out), ptr_arg(extra), ptr_arg(lp), i32_arg(N),
                                i32_arg(node.attrs["reduction"] == "mean")]))
    return launches
