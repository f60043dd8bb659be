"""The CUDA lowering of the loss family (kernels in loss.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.errors import CudaError
from toygraph.ops.gemm.cuda import BF16_GEMM_PRECISION, block_mm, dense_mm, row_bytes
from toygraph.ops.gemm.cuda_tc import K_ALIGN, Gemm, bf16_copy, deq_launch, gemm_launches
from toygraph.ops.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                   ptr_arg, rows_grid)
from toygraph.ops.lowering.constants import MM_BM

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "loss.cu")


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
