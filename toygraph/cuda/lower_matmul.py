"""Lowering of matmuls: f32 tiles, tensor-core (bf16/tf32) tiles, and weights read in their
GGUF block format (qmatmul.cu)."""
from __future__ import annotations

from math import prod

from ..errors import CudaError
from .constants import MM_BM, MM_THREADS, TC_BM, TC_THREADS
from .kernels import QUANT_KERNELS, TC_KERNELS
from .launch import MAX_GRID_YZ, Launch, _pad, contiguous_strides, i32, p, strided
from .registry import lowers

#: Output tile edge of the tensor-core kernels (square: TC_BM == TC_BN, checked by a test;
#: so are the f32 tiles, MM_BM == MM_BN).
TC_TILE = TC_BM


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


def _matmul(node, out, ptr, tile: int = MM_BM, kernel: str = "tg_matmul",
            threads: int = MM_THREADS) -> Launch:
    M, N, K, sam, sak, sbk, sbn, nbatch, dims, sa, sb = matmul_geometry(node)
    x, y = node.srcs
    gy = (M + tile - 1) // tile
    if gy > MAX_GRID_YZ:
        raise CudaError(f"matmul {node.name!r}: {M} rows exceed the kernel's grid limit")
    grid = ((N + tile - 1) // tile, gy, max(1, min(nbatch, MAX_GRID_YZ)))
    return Launch(kernel, grid, [p(out), p(ptr(x)), p(ptr(y)), i32(M), i32(N), i32(K),
                                 i32(sam), i32(sak), i32(sbk), i32(sbn), i32(nbatch),
                                 strided(dims, sa, sb)], block=(threads, 1, 1))


def _tc_matmul(node, out, ptr, raw_consts, precision: str) -> Launch:
    """The tensor-core launch for a matmul: dense operands take tg_matmul's arguments (so
    every trans/batch/grouped-query case is covered), a block-format weight the fused
    kernels' arguments."""
    if precision not in TC_KERNELS:
        raise CudaError(f"matmul {node.name!r}: no tensor-core kernels for precision "
                        f"{precision!r} (have {sorted(TC_KERNELS)})")
    table = TC_KERNELS[precision]
    if node.srcs[1].id in raw_consts:
        q = _qmatmul(node, out, ptr, tile=TC_TILE)
        return Launch(table["nt" if node.attrs["trans_b"] else "nn"][node.srcs[1].storage],
                      q.grid, q.args, block=(TC_THREADS, 1, 1))
    return _matmul(node, out, ptr, tile=TC_TILE, kernel=table["matmul"], threads=TC_THREADS)


def row_bytes(w) -> int:
    """Bytes of one row of the 2-D block-format const ``w``."""
    from .. import quant
    return quant.nbytes(w.storage, (1, w.shape[1]))


def _qmatmul(node, out, ptr, tile: int = MM_BM) -> Launch:
    """x @ W^T (trans_b) or dy @ W on a block-format W [rows, cols]; x's batch axes fold
    into M since the 2-D W is shared by every batch entry and all buffers are contiguous."""
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
                  [p(out), p(ptr(x)), p(ptr(w)), i32(M), i32(N), i32(K), i32(row_bytes(w))],
                  block=(MM_THREADS, 1, 1))


def _weight_in_blocks(node, index: int) -> bool:
    """A matmul reads its b in block format as the weight of ``x @ W^T`` / ``dy @ W``: a
    2-D b, trans_a=False, a's batch axes folded into M."""
    return index == 1 and node.srcs[0] is not node.srcs[1] and not node.attrs["trans_a"]


@lowers("matmul", kernels=("tg_matmul",), block_format=_weight_in_blocks)
def _lower_matmul(node, at):
    """f32: tg_matmul, or the QUANT_KERNELS of a block-format weight; bf16/tf32: the
    tensor-core twins (TC_KERNELS)."""
    if at.precision != "f32":
        return [_tc_matmul(node, at.out, at.ptr, at.raw_consts, at.precision)]
    if node.srcs[1].id in at.raw_consts:
        return [_qmatmul(node, at.out, at.ptr)]
    return [_matmul(node, at.out, at.ptr)]
