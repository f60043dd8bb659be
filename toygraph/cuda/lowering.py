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

from dataclasses import dataclass, field
from math import prod

import numpy as np

from ..errors import CudaError

MAXD = 8          # TG_MAXD in common.cuh
THREADS = 256     # TG_THREADS in common.cuh
MAX_GRID = 1 << 20  # grid-stride loops cover the rest
MAX_GRID_YZ = 65535
SUMSQ_BLOCKS = 1024  # at most this many partial sums per gradient in global_norm
INT32_MAX = 2 ** 31 - 1
# Grid-stride loops index with int: i + gridDim*blockDim must not overflow past the end.
MAX_ELEMENTS = INT32_MAX - MAX_GRID * THREADS


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    args: list = field(default_factory=list)   # numpy arrays, one per kernel parameter
    block: tuple[int, int, int] = (THREADS, 1, 1)
    shmem: int = 0


# --- argument packing ----------------------------------------------------------------------
def p(addr: int) -> np.ndarray:
    return np.array([addr], np.uint64)


def i32(v: int) -> np.ndarray:
    v = int(v)
    if not -2 ** 31 <= v <= INT32_MAX:
        raise CudaError(f"kernel argument {v} does not fit in int32")
    return np.array([v], np.int32)


def f32(v: float) -> np.ndarray:
    return np.array([v], np.float32)


def f64(v: float) -> np.ndarray:
    return np.array([v], np.float64)


def contiguous_strides(shape) -> list[int]:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= int(s)
    return out[::-1]


def collapse(dims, *strides):
    """Drop size-1 dims and merge neighbours that walk memory as one dim in every operand."""
    keep = [i for i, d in enumerate(dims) if d != 1]
    dims = [int(dims[i]) for i in keep]
    strides = [[int(s[i]) for i in keep] for s in strides]
    i = len(dims) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * dims[i + 1] for s in strides):
            dims[i] *= dims[i + 1]
            for s in strides:
                s[i] = s[i + 1]
                del s[i + 1]
            del dims[i + 1]
        i -= 1
    return dims, strides


def strided(dims, sa, sb=None) -> np.ndarray:
    """Pack a ``Strided`` struct (int nd; int dims[8], sa[8], sb[8]) as 25 int32s."""
    sb = [0] * len(dims) if sb is None else sb
    dims, (sa, sb) = collapse(dims, sa, sb)
    if len(dims) > MAXD:
        raise CudaError(f"a strided walk over {len(dims)} dims exceeds the kernels' {MAXD}")
    buf = np.zeros(1 + 3 * MAXD, np.int32)
    buf[0] = len(dims)
    for k, vals in enumerate((dims, sa, sb)):
        buf[1 + k * MAXD:1 + k * MAXD + len(vals)] = vals
    return buf


def _blocks(n: int) -> tuple[int, int, int]:
    return (max(1, min((int(n) + THREADS - 1) // THREADS, MAX_GRID)), 1, 1)


def _rows_grid(rows: int) -> tuple[int, int, int]:
    return (max(1, min(int(rows), MAX_GRID)), 1, 1)


def _pad(shape, n):
    return (1,) * (n - len(shape)) + tuple(shape)


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


def matmul_batch(a_shape, b_shape, out_batch):
    """(dims, a strides, b strides) over the output batch axes; grouped axes are split into
    (kv heads, group) with b's group stride 0, like the numpy kernel's reshape."""
    n = len(out_batch)
    ab, bb = _pad(a_shape[:-2], n), _pad(b_shape[:-2], n)
    a_cs = contiguous_strides(_pad(a_shape, n + 2))[:n]
    b_cs = contiguous_strides(_pad(b_shape, n + 2))[:n]
    dims, sa, sb = [], [], []
    for o, x, y, ca, cb in zip(out_batch, ab, bb, a_cs, b_cs):
        xa = ca if x == o else 0
        if y == o or y == 1:
            dims.append(o), sa.append(xa), sb.append(cb if y == o else 0)
        else:
            g = o // y
            dims += [y, g]
            sa += [xa * g, xa]
            sb += [cb, 0]
    return dims, sa, sb


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


#: Storage formats the fused kernels of qmatmul.cu read (f32 consts are used as they are).
BLOCK_STORAGE = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")


def reads_block_format(node, index: int) -> bool:
    """Whether ``node`` can read its source ``index`` (a const) in its block format: as
    the weight of ``x @ W^T`` / ``dy @ W`` (a 2-D b, trans_a=False, a's batch axes folded
    into M), or as the table of get_rows."""
    src = node.srcs[index]
    if src.role != "const" or src.storage not in BLOCK_STORAGE or len(src.shape) != 2:
        return False
    if node.op == "get_rows":
        return index == 0
    if node.op == "matmul":
        return index == 1 and node.srcs[0] is not src and not node.attrs["trans_a"]
    if node.op in ("linear_cross_entropy", "linear_cross_entropy_back"):
        # the head as the weight of logits = h W^T and dh = dlogits W; a frozen const has
        # no dw, the one product that would read W another way
        return index == 1 and node.srcs[0] is not src and not node.attrs.get("grad_w")
    return False


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
    if op == "rope":
        B, S, H, D = s[0].shape
        return [Launch("tg_rope", _blocks(n), [p(out), p(ptr(s[0])), p(ptr(s[1])), i32(n), i32(H),
                                                 i32(D), i32(a["dims"]), f64(a["base"]),
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


#: head_dim bound -> (BT, TPR) of the attention kernels (the template arguments of the
#: instantiations in attention.cu): BT x BT query/key tiles, TPR threads per tile row.
ATTN_TILES = {32: (32, 4), 64: (32, 4), 128: (16, 8)}


def attention_config(hd: int) -> tuple[int, int, int]:
    """(HD, BT, TPR) of the kernels that run head_dim ``hd``: the smallest HD >= hd."""
    for HD in sorted(ATTN_TILES):
        if hd <= HD:
            return (HD, *ATTN_TILES[HD])
    raise CudaError(f"attention: head_dim {hd} exceeds the kernels' maximum {max(ATTN_TILES)}")


def _attention(node, out, ptr, scratch) -> list[Launch]:
    """attention: one launch, a block per (query tile, head, batch). attention_back: the
    row statistics into scratch, then dk/dv per (key tile, kv head, batch) and dq per
    (query tile, head, batch), written straight into the packed [dq, dk, dv] output."""
    q, k, v = node.srcs[:3]
    B, H, T, hd = q.shape
    KV = k.shape[1]
    HD, BT, TPR = attention_config(hd)
    if max(H, B) > MAX_GRID_YZ:
        raise CudaError(f"attention {node.name!r}: {B} x {H} exceeds the grid limit")
    tiles = (T + BT - 1) // BT
    common = [i32(H), i32(KV), i32(T), i32(hd), f32(node.attrs["scale"]),
              i32(node.attrs["causal"])]
    block = (BT * TPR, 1, 1)
    per_head, per_kv = (tiles, H, B), (tiles, KV, B)
    if node.op == "attention":
        return [Launch(f"tg_attn_fwd_{HD}", per_head,
                       [p(out), p(ptr(q)), p(ptr(k)), p(ptr(v)), *common], block)]
    o, g = node.srcs[3:]
    lse, delta = scratch, scratch + 4 * B * H * T
    dq, dk, dv = out, out + 4 * q.size, out + 4 * (q.size + k.size)
    stats = [p(lse), p(delta)]
    qkvg = [p(ptr(q)), p(ptr(k)), p(ptr(v)), p(ptr(g))]
    return [Launch(f"tg_attn_bwd_prep_{HD}", per_head,
                   [*stats, p(ptr(q)), p(ptr(k)), p(ptr(o)), p(ptr(g)), *common], block),
            Launch(f"tg_attn_bwd_dkdv_{HD}", per_kv, [p(dk), p(dv), *qkvg, *stats, *common],
                   block),
            Launch(f"tg_attn_bwd_dq_{HD}", per_head, [p(dq), *qkvg, *stats, *common], block)]


def matmul_geometry(node):
    """(M, N, K, sam, sak, sbk, sbn, nbatch, batch dims, a strides, b strides) of a dense
    matmul: A(m, k) = a[m*sam + k*sak], B(k, n) = b[k*sbk + n*sbn], plus the batch walk."""
    (x, y), ta, tb = node.srcs, node.attrs["trans_a"], node.attrs["trans_b"]
    M, N = node.shape[-2], node.shape[-1]
    K = x.shape[-2] if ta else x.shape[-1]
    sam, sak = (1, M) if ta else (K, 1)
    sbk, sbn = (1, K) if tb else (N, 1)
    out_batch = node.shape[:-2]
    nbatch = prod(out_batch)
    dims, sa, sb = matmul_batch(x.shape, y.shape, out_batch)
    return M, N, K, sam, sak, sbk, sbn, nbatch, dims, sa, sb


def _matmul(node, out, ptr, tile: int = 64, kernel: str = "tg_matmul") -> Launch:
    M, N, K, sam, sak, sbk, sbn, nbatch, dims, sa, sb = matmul_geometry(node)
    x, y = node.srcs
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"matmul {node.name!r}: {M} rows exceed the kernel's grid limit")
    grid = ((N + tile - 1) // tile, gy, max(1, min(nbatch, MAX_GRID_YZ)))
    return Launch(kernel, grid, [p(out), p(ptr(x)), p(ptr(y)), i32(M), i32(N), i32(K),
                                 i32(sam), i32(sak), i32(sbk), i32(sbn), i32(nbatch),
                                 strided(dims, sa, sb)])


#: Output tile edge of the tensor-core kernels (TC_BM == TC_BN in tc_layout.cuh).
TC_TILE = 128


def _tc_matmul(node, out, ptr, raw_consts, precision: str) -> Launch:
    """The tensor-core launch for a matmul: dense operands take tg_matmul's arguments (so
    every trans/batch/grouped-query case is covered), a block-format weight the fused
    kernels' arguments."""
    from .kernels import TC_KERNELS
    if precision not in TC_KERNELS:
        raise CudaError(f"matmul {node.name!r}: no tensor-core kernels for precision "
                        f"{precision!r} (have {sorted(TC_KERNELS)})")
    table = TC_KERNELS[precision]
    if node.srcs[1].id in raw_consts:
        q = _qmatmul(node, out, ptr, tile=TC_TILE)
        return Launch(table["nt" if node.attrs["trans_b"] else "nn"][node.srcs[1].storage],
                      q.grid, q.args, block=(256, 1, 1))
    return _matmul(node, out, ptr, tile=TC_TILE, kernel=table["matmul"])


def row_bytes(w) -> int:
    """Bytes of one row of the 2-D block-format const ``w``."""
    from .. import quant
    return quant.nbytes(w.storage, (1, w.shape[1]))


def _qmatmul(node, out, ptr, tile: int = 64) -> Launch:
    """x @ W^T (trans_b) or dy @ W on a block-format W [rows, cols]; x's batch axes fold
    into M since the 2-D W is shared by every batch entry and all buffers are contiguous."""
    from .kernels import QUANT_KERNELS
    (x, w), tb = node.srcs, node.attrs["trans_b"]
    K = x.shape[-1]
    M = x.size // K if K else 0
    N = w.shape[0] if tb else w.shape[1]
    if K != (w.shape[1] if tb else w.shape[0]):
        raise CudaError(f"matmul {node.name!r}: inner dimensions {x.shape} and {w.shape} differ")
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"matmul {node.name!r}: {M} rows exceed the kernel's grid limit")
    kernel = QUANT_KERNELS[w.storage]["nt" if tb else "nn"]
    return Launch(kernel, (max(1, (N + tile - 1) // tile), max(1, gy), 1),
                  [p(out), p(ptr(x)), p(ptr(w)), i32(M), i32(N), i32(K), i32(row_bytes(w))])


# --- fused output head + cross-entropy --------------------------------------------------------
#: Bytes of the [rows, vocab] f32 logits block one chunk of linear_cross_entropy uses (its
#: only vocabulary-sized buffer). 256 MiB is 1344 rows of SmolLM2's 49152-token vocabulary:
#: enough rows that dh = dlogits @ W (K = vocab, N = n_embd) still fills the GPU.
LCE_CHUNK_BYTES = 256 << 20


def lce_chunk_rows(n_rows: int, vocab: int) -> int:
    """Rows per chunk: as many as LCE_CHUNK_BYTES holds, a multiple of the 64-row matmul
    tile when that is at least one tile, never more than the rows there are."""
    rows = LCE_CHUNK_BYTES // (4 * vocab)
    if rows >= 64:
        rows = rows // 64 * 64
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
    tile, block = 64, (THREADS, 1, 1)
    if precision != "f32" and kernel == "tg_matmul":
        from .kernels import TC_KERNELS
        kernel, tile = TC_KERNELS[precision]["matmul"], TC_TILE
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{kernel}: {M} rows exceed the kernel's grid limit")
    return Launch(kernel, ((N + tile - 1) // tile, gy, 1),
                  [p(out), p(a), p(b), i32(M), i32(N), i32(K), i32(sam), i32(sak), i32(sbk),
                   i32(sbn), i32(1), strided([], [])], block)


def _q_mm(out, a, w, w_ptr, M, N, K, kind, precision) -> Launch:
    """x @ W^T ("nt") or dy @ W ("nn") with the block-format const ``w`` at ``w_ptr``, with
    _qmatmul's arguments (tensor-core twins for bf16/tf32, as _tc_matmul picks them)."""
    from .kernels import QUANT_KERNELS, TC_KERNELS
    kernel, tile = QUANT_KERNELS[w.storage][kind], 64
    if precision != "f32":
        kernel, tile = TC_KERNELS[precision][kind][w.storage], TC_TILE
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"{kernel}: {M} rows exceed the kernel's grid limit")
    return Launch(kernel, (max(1, (N + tile - 1) // tile), max(1, gy), 1),
                  [p(out), p(a), p(w_ptr), i32(M), i32(N), i32(K), i32(row_bytes(w))])


def _linear_cross_entropy(node, out, ptr, scratch, raw_consts, precision) -> list[Launch]:
    """Launches over chunks of ``rows`` rows sharing one [rows, V] logits block in scratch.

    forward:  per chunk  logits = h_c W^T;  tg_ce_rows -> rowloss[c]
              then       tg_ce_reduce(rowloss, all labels) -> the loss
    backward: tg_lce_grad_scale -> gs (g, or g / n for mean); tg_fill dw = 0 if dw is asked
              per chunk  logits = h_c W^T;  tg_ce_back in place -> dlogits_c (weight gs)
                         dh_c = dlogits_c W          (into dh's rows of the chunk)
                         dw += dlogits_c^T h_c       (tg_matmul_acc; chunk order fixed)
    """
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
