"""The numpy kernels of the gemm family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import block_kernel, kernel


@kernel("matmul")
def _matmul_numpy(out, srcs, attrs):
    a, b = srcs
    if attrs.get("scale_a", 1.0) != 1.0:
        a = np.multiply(a, out.dtype.type(attrs["scale_a"]))
    if attrs["trans_a"]:
        a = np.swapaxes(a, -1, -2)
    if attrs["trans_b"]:
        b = np.swapaxes(b, -1, -2)
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous and out.flags.c_contiguous:
        # [..., M, K] @ [K, N] as one [rows, K] @ [K, N] GEMM: numpy would run the stack as
        # one BLAS call per matrix, 25-40% slower at a training step's row counts.
        np.matmul(a.reshape(-1, a.shape[-1]), b, out=out.reshape(-1, out.shape[-1]))
        return
    if b.ndim > 2:
        ab, bb = a.shape[:-2], (1,) * (a.ndim - b.ndim) + b.shape[:-2]
        if any(x != y and y != 1 and x != 1 for x, y in zip(ab, bb)):
            # Grouped-query: split each grouped axis of a into (kv_heads, group) and give b
            # a size-1 group axis, so plain broadcasting shares each K/V head.
            a_split, b_split = [], []
            for x, y in zip(ab, bb):
                if x != y and y != 1 and x != 1:
                    a_split += [y, x // y]
                    b_split += [y, 1]
                else:
                    a_split.append(x)
                    b_split.append(y)
            a = a.reshape(tuple(a_split) + a.shape[-2:])
            b = b.reshape(tuple(b_split) + b.shape[-2:])
            np.matmul(a, b, out=out.reshape(tuple(a_split) + out.shape[-2:]))
            return
    np.matmul(a, b, out=out)


@kernel("matmul_add")
def _matmul_add_numpy(out, srcs, attrs):
    _matmul_numpy(out, srcs[1:], attrs)
    _epilogue(out, srcs[0], attrs)


def _epilogue(out, add, attrs):
    """matmul_add's add + alpha * product, rounded as scale then add (never an fma)."""
    if attrs["alpha"] != 1.0:
        np.multiply(out, out.dtype.type(attrs["alpha"]), out=out)
    np.add(add, out, out=out)


# --- numpy backend, a frozen weight kept in its blocks ------------------------------------------
def engine_multiplies(w, itemsize: int) -> bool:
    """Whether the CPU engine computes products with the weight ``w`` on its blocks: f32
    buffers, ``w`` 2-D in a format the engine knows (x W^T forward, g W backward:
    toygraph/cpu/gemm.h and dot.h)."""
    from toygraph.cpu import engine
    return itemsize == 4 and len(w.shape) == 2 and engine.available(w.storage)


def _engine_multiplies(node, itemsize: int) -> bool:
    """A matmul (matmul_add) whose weight is its last source and whose other operand is
    not transposed, for the engine (engine_multiplies)."""
    return not node.attrs["trans_a"] and engine_multiplies(node.srcs[-1], itemsize)


@block_kernel("matmul", reads=(1,), when=_engine_multiplies)
def _matmul_blocks(out, srcs, attrs, scratch):
    """b is a cpu.block_tensor.BlockTensor: the engine multiplies on its blocks, panel by
    panel, every row of a (its leading axes flattened) at once; scale_a is applied to a
    first, as the plain kernel applies it."""
    a, w = srcs
    if attrs.get("scale_a", 1.0) != 1.0:
        a = np.multiply(a, out.dtype.type(attrs["scale_a"]))
    elif (attrs["trans_b"] and a.size <= w.FEW_ROWS * a.shape[-1] and a.flags.c_contiguous
          and out.flags.c_contiguous):
        w.matmul_few_rows(a, out)   # generation's step: the same buffers every token
        return
    rows = np.ascontiguousarray(a).reshape(-1, a.shape[-1])
    flat = out.reshape(-1, out.shape[-1])
    if attrs["trans_b"]:
        w.matmul_nt(rows, flat)
    else:
        w.matmul_nn(rows, flat)


@block_kernel("matmul_add", reads=(2,), when=_engine_multiplies)
def _matmul_add_blocks(out, srcs, attrs, scratch):
    _matmul_blocks(out, srcs[1:], attrs, scratch)
    _epilogue(out, srcs[0], attrs)
