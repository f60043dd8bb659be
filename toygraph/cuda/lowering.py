"""Lowering: one graph node -> the kernel launches that compute it.

Everything shape-dependent is worked out here on the host, once, at realize: strides for
broadcasting, permutes, grouped-query sharing and reductions are packed into the
``Strided`` struct of kernels/common.cuh, and every scalar is a fixed-width numpy value
(np.int32 / np.float32 / np.float64, pointers np.uint64), never a Python int or float.

>>> launches = lower(node, ptr_of, scratch_ptr)     # doctest: +SKIP
>>> [l.kernel for l in launches]                    # doctest: +SKIP
['tg_ce_rows', 'tg_ce_reduce']

Consts whose ids are in ``raw_consts`` live on the device in their GGUF block format; their
consumers must be ones :func:`reads_block_format` accepts (a 2-D weight as a matmul's b
with trans_a=False, or a get_rows table), which lower to the fused kernels of qmatmul.cu.
"""
from __future__ import annotations

from math import prod



from ..errors import CudaError
# The launch vocabulary and the matmul/fused lowerings live in their own modules; the
# names the backend, devmem and the tests use are re-exported from here.
from .launch import (MAX_ELEMENTS, MAX_GRID, MAX_GRID_YZ, MAXD, SUMSQ_BLOCKS, THREADS,
                     Launch, _blocks, _pad, _rows_grid, collapse, contiguous_strides, f32, f64,
                     i32, p, strided)
from .lower_fused import (ATTN_TILES, _attention, _lce_scratch, _linear_cross_entropy,
                          attention_config, lce_chunk_rows)
from .lower_matmul import (BLOCK_STORAGE, TC_TILE, _matmul, _qmatmul, _tc_matmul,
                           matmul_batch, reads_block_format, row_bytes)

__all__ = ["lower", "scratch_bytes", "broadcast_strides", "expand_walk", "sum_to_walk",
           "MAX_ELEMENTS", "MAX_GRID", "MAX_GRID_YZ", "MAXD", "THREADS", "Launch", "collapse",
           "contiguous_strides", "strided", "p", "i32", "f32", "f64", "ATTN_TILES",
           "attention_config", "lce_chunk_rows", "BLOCK_STORAGE", "TC_TILE", "matmul_batch",
           "reads_block_format", "row_bytes"]


# --- shape walks -----------------------------------------------------------------------------
def broadcast_strides(src_shape, out_shape) -> list[int]:
    src = _pad(src_shape, len(out_shape))
    cs = contiguous_strides(src)
    return [0 if s == 1 and o != 1 else c for s, o, c in zip(src, out_shape, cs)]


def expand_walk(src_shape, out_shape):
    """(dims, src strides) that walk ``out_shape`` reading the broadcast/repeated source."""
    src = _pad(src_shape, len(out_shape))
    cs = contiguous_strides(src)
    dims, sa = [], []
    for s, o, c in zip(src, out_shape, cs):
        if s == o:
            dims.append(o), sa.append(c)
        elif s == 1:
            dims.append(o), sa.append(0)
        else:  # grouped: np.repeat of each entry o // s times
            dims += [s, o // s]
            sa += [c, 0]
    return dims, sa


def sum_to_walk(x_shape, target):
    """(kept dims, kept strides, reduced dims, reduced strides) reducing x to ``target``."""
    small = _pad(target, len(x_shape))
    cs = contiguous_strides(x_shape)
    kd, ks, rd, rs = [], [], [], []
    for xd, sd, c in zip(x_shape, small, cs):
        if xd == sd:
            kd.append(xd), ks.append(c)
        elif sd == 1:
            rd.append(xd), rs.append(c)
        else:  # grouped: x's entry i belongs to target entry i // g
            g = xd // sd
            kd.append(sd), ks.append(c * g)
            rd.append(g), rs.append(c)
    return kd, ks, rd, rs


# --- per-op lowering -------------------------------------------------------------------------
def scratch_bytes(node) -> int:
    """Device scratch a node needs besides its output (filled by its own launches)."""
    if node.op == "attention_back":  # row log-sum-exp and rowsum(dO * O), [B, H, T] each
        return 2 * 4 * node.srcs[0].size // node.srcs[0].shape[-1]
    if node.op == "cross_entropy":
        return 4 * node.srcs[0].shape[0]
    if node.op == "global_norm":
        return 8 * sum(_sumsq_blocks(g.size) for g in node.srcs[:-1])
    if node.op in ("linear_cross_entropy", "linear_cross_entropy_back"):
        return sum(_lce_scratch(node).values())
    return 0


def _sumsq_blocks(n: int) -> int:
    return max(1, min((n + THREADS - 1) // THREADS, SUMSQ_BLOCKS))


def _reduce(out_ptr, x_ptr, kd, ks, rd, rs) -> Launch:
    n_out, n_red = prod(kd), prod(rd)
    args = [p(out_ptr), p(x_ptr), i32(n_out), strided(kd, ks), strided(rd, rs), i32(n_red)]
    if n_red <= 64 and n_out > 1:
        return Launch("tg_reduce_thread", _blocks(n_out), args)
    return Launch("tg_reduce_block", _rows_grid(n_out), args)


def lower(node, ptr, scratch: int = 0, raw_consts=frozenset(), precision: str = "f32"
          ) -> list[Launch]:
    """The launches computing ``node``; ``ptr(t)`` is the device address of tensor t (for a
    const in ``raw_consts``, the address of its block bytes). ``precision`` "bf16"/"tf32"
    lowers matmuls to the tensor-core kernels of tc_matmul.cu (same arguments, 128 x 128
    tiles); every other op, and every op at "f32", lowers as it always has."""
    op, s, a = node.op, node.srcs, node.attrs
    for i, src in enumerate(s):
        if src.id in raw_consts and not reads_block_format(node, i):
            raise CudaError(f"{op} {node.name!r} cannot read const {src.name!r} in its "
                            f"{src.storage} block format")
    out = ptr(node) if op not in ("accumulate", "adamw") else 0
    n = node.size
    if op in ("add", "sub", "mul"):
        code = {"add": 0, "sub": 1, "mul": 2}[op]
        sa = broadcast_strides(s[0].shape, node.shape)
        sb = broadcast_strides(s[1].shape, node.shape)
        return [Launch("tg_binary", _blocks(n), [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(n),
                                                   strided(node.shape, sa, sb), i32(code)])]
    if op == "scale":
        return [Launch("tg_scale", _blocks(n), [p(out), p(ptr(s[0])), i32(n), f32(a["s"])])]
    if op == "silu":
        return [Launch("tg_silu", _blocks(n), [p(out), p(ptr(s[0])), i32(n)])]
    if op == "silu_back":
        return [Launch("tg_silu_back", _blocks(n), [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(n)])]
    if op == "gelu":
        return [Launch("tg_gelu", _blocks(n), [p(out), p(ptr(s[0])), i32(n)])]
    if op == "gelu_back":
        return [Launch("tg_gelu_back", _blocks(n), [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(n)])]
    if op in ("reshape", "contiguous"):
        return [Launch("tg_copy", _blocks(n), [p(out), p(ptr(s[0])), i32(n)])]
    if op == "permute":
        cs = contiguous_strides(s[0].shape)
        sa = [cs[ax] for ax in a["axes"]]
        return [Launch("tg_gather", _blocks(n), [p(out), p(ptr(s[0])), i32(n),
                                                   strided(node.shape, sa)])]
    if op == "expand":
        dims, sa = expand_walk(s[0].shape, node.shape)
        return [Launch("tg_gather", _blocks(n), [p(out), p(ptr(s[0])), i32(n), strided(dims, sa)])]
    if op == "sum_to":
        return [_reduce(out, ptr(s[0]), *sum_to_walk(s[0].shape, node.shape))]
    if op == "sum":
        shape, ax = s[0].shape, a["axis"]
        cs = contiguous_strides(shape)
        if ax is None:
            return [_reduce(out, ptr(s[0]), [], [], list(shape), cs)]
        kd = [d for i, d in enumerate(shape) if i != ax]
        ks = [c for i, c in enumerate(cs) if i != ax]
        return [_reduce(out, ptr(s[0]), kd, ks, [shape[ax]], [cs[ax]])]
    if op in ("rms_norm", "rms_norm_back"):
        D = node.shape[-1] if node.shape else 1
        rows = n // D
        srcs = [p(ptr(t)) for t in s]
        return [Launch("tg_" + op, _rows_grid(rows),
                       [p(out), *srcs, i32(rows), i32(D), f32(a["eps"])])]
    if op == "rope":  # a null factors pointer: no frequency factors
        B, S, H, D = s[0].shape
        factors = ptr(s[2]) if len(s) == 3 else 0
        return [Launch("tg_rope", _blocks(n),
                       [p(out), p(ptr(s[0])), p(ptr(s[1])), p(factors), i32(n), i32(H), i32(D),
                        i32(a["dims"]), f64(a["base"]), f64(a["freq_scale"]),
                        i32(a["mode"] == "neox"), i32(a["inverse"])])]
    if op == "softmax":
        T = node.shape[-1] if node.shape else 1
        rows = n // T
        return [Launch("tg_softmax", _rows_grid(rows), [p(out), p(ptr(s[0])), i32(rows), i32(T),
                                                        f32(a["scale"]), i32(a["causal"])])]
    if op == "softmax_back":
        T = node.shape[-1] if node.shape else 1
        rows = n // T
        return [Launch("tg_softmax_back", _rows_grid(rows),
                       [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(rows), i32(T), f32(a["scale"])])]
    if op in ("attention", "attention_back"):
        return _attention(node, out, ptr, scratch)
    if op == "unpack":  # a copy out of the packed buffer, read from the element offset on
        return [Launch("tg_copy", _blocks(n), [p(out), p(ptr(s[0]) + 4 * a["offset"]), i32(n)])]
    if op == "matmul":
        if precision != "f32":
            return [_tc_matmul(node, out, ptr, raw_consts, precision)]
        if s[1].id in raw_consts:
            return [_qmatmul(node, out, ptr)]
        return [_matmul(node, out, ptr)]
    if op == "get_rows" and s[0].id in raw_consts:
        from .kernels import QUANT_KERNELS
        D = s[0].shape[1]
        return [Launch(QUANT_KERNELS[s[0].storage]["rows"], _blocks(n),
                       [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(n), i32(D),
                        i32(row_bytes(s[0]))])]
    if op == "get_rows":
        D = s[0].shape[1]
        return [Launch("tg_get_rows", _blocks(n), [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(n),
                                                     i32(D)])]
    if op == "get_rows_back":
        N, D = s[1].size, node.shape[1]
        return [Launch("tg_fill", _blocks(n), [p(out), i32(n), f32(0.0)]),
                Launch("tg_get_rows_back", _rows_grid(N),
                       [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(N), i32(D)])]
    if op == "cross_entropy":
        N, V = s[0].shape
        mean = i32(a["reduction"] == "mean")
        return [Launch("tg_ce_rows", _rows_grid(N), [p(scratch), p(ptr(s[0])), p(ptr(s[1])),
                                                     i32(N), i32(V)]),
                Launch("tg_ce_reduce", (1, 1, 1), [p(out), p(scratch), p(ptr(s[1])), i32(N), mean])]
    if op == "cross_entropy_back":
        N, V = s[0].shape
        return [Launch("tg_ce_back", _rows_grid(N),
                       [p(out), p(ptr(s[0])), p(ptr(s[1])), p(ptr(s[2])), i32(N), i32(V),
                        i32(a["reduction"] == "mean")])]
    if op in ("linear_cross_entropy", "linear_cross_entropy_back"):
        return _linear_cross_entropy(node, out, ptr, scratch, raw_consts, precision)
    if op == "count_valid":
        return [Launch("tg_count_valid", (1, 1, 1), [p(out), p(ptr(s[0])), i32(s[0].size)])]
    if op == "accumulate":
        return [Launch("tg_accumulate", _blocks(s[0].size),
                       [p(ptr(s[0])), p(ptr(s[1])), i32(s[0].size)])]
    if op == "global_norm":
        launches, offset = [], 0
        for g in s[:-1]:
            nb = _sumsq_blocks(g.size)
            launches.append(Launch("tg_sumsq_partial", (nb, 1, 1),
                                   [p(scratch + 8 * offset), p(ptr(g)), i32(g.size)]))
            offset += nb
        launches.append(Launch("tg_global_norm", (1, 1, 1),
                               [p(out), p(scratch), i32(offset), p(ptr(s[-1]))]))
        return launches
    if op == "adamw":
        w, g, m, v, hp, norm, div = s
        return [Launch("tg_adamw", _blocks(w.size),
                       [p(ptr(w)), p(ptr(g)), p(ptr(m)), p(ptr(v)), p(ptr(hp)), p(ptr(norm)),
                        p(ptr(div)), i32(w.size), f64(a["max_norm"])])]
    raise CudaError(f"the CUDA backend has no lowering for op {op!r} (node {node.name!r})")
