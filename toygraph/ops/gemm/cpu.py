"""The gemm family's engine replay (cpu.h beside this): matmul and matmul_add of 2-D
operands (a's leading axes flattened into rows), the weight in its GGUF blocks (the
engine's products, as the numpy backend's block kernel calls them) or in f32; and the
products of one x of a few rows with several weights in blocks as one call (siblings)."""
from __future__ import annotations

import numpy as np

from toygraph.cpu import engine
from toygraph.cpu.block_tensor import BlockTensor
from toygraph.cpu.replay import Call, f32_contiguous, replays, siblings


def _on_blocks(out, a, w, attrs, add, alpha):
    """c = a . W^T (trans_b) or a . W, W a BlockTensor [N, K] the engine multiplies."""
    if attrs["trans_a"] or attrs.get("scale_a", 1.0) != 1.0 or not w.computes_on_blocks:
        return None
    weight = w.weight()
    transposed = bool(attrs["trans_b"])
    width_a, width_c = (weight.K, weight.N) if transposed else (weight.N, weight.K)
    if a.shape[-1] != width_a or out.shape[-1] != width_c:
        return None
    rows = a.size // width_a
    # a few rows: the dot kernels the weight picks for them (TOYGRAPH_CPU_DOT)
    kernel = weight.few_rows_kernel if transposed and rows <= engine.DOT_MAX_M else 0
    return Call("matmul_blocks", [out, a, weight.data, add],
                [engine.FORMATS.index(weight.fmt), weight.row_bytes, weight.N, weight.K, rows,
                 transposed, kernel], [alpha])


def _in_f32(out, a, b, attrs, add, alpha):
    """c [M, N] = (s op(a)) . op(b): b 2-D (a 2-D, or with leading axes when not
    transposed), or a batch of products: a and b of one rank with the same leading axes."""
    ta, tb = attrs["trans_a"], attrs["trans_b"]
    batch = 1
    if b.ndim > 2:
        if a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or out.shape[:-2] != a.shape[:-2]:
            return None
        batch = int(np.prod(a.shape[:-2]))
        a2, b2 = a.shape[-2:], b.shape[-2:]
    elif ta and a.ndim != 2:
        return None
    else:
        a2, b2 = (a.shape if ta else (a.size // max(a.shape[-1], 1), a.shape[-1])), b.shape
    K = a2[0] if ta else a2[1]
    M = a2[1] if ta else a2[0]
    N = b2[0] if tb else b2[1]
    if (b2[1] if tb else b2[0]) != K or out.size != batch * M * N:
        return None
    return Call("matmul_f32", [out, a, b, add], [M, K, N, ta, tb, batch],
                [attrs.get("scale_a", 1.0), alpha])


def _call(out, a, b, attrs, add=None, alpha=1.0):
    if not f32_contiguous(out, a) or (add is not None and not f32_contiguous(add)):
        return None
    if add is not None and add.shape != out.shape:
        return None
    if isinstance(b, BlockTensor):
        return _on_blocks(out, a, b, attrs, add, alpha)
    return _in_f32(out, a, b, attrs, add, alpha) if f32_contiguous(b) else None


@replays("matmul")
def _matmul(node, out, srcs, attrs):
    return _call(out, srcs[0], srcs[1], attrs)


@replays("matmul_add")
def _matmul_add(node, out, srcs, attrs):
    return _call(out, srcs[1], srcs[2], attrs, srcs[0], attrs["alpha"])


#: Weights one call multiplies with a shared x at most (the kernel's operand slots).
SHARED_X_MAX = 4


def _on_blocks_weight(node, srcs) -> bool:
    """A product whose weight is kept in blocks (not a LoRA adapter's x A^T beside it)."""
    return len(srcs) > 1 and isinstance(srcs[1], BlockTensor)


@siblings("matmul", joins=_on_blocks_weight)
def _shared_x(nodes, outs, srcs):
    """Products of one x of a few rows with weights in blocks (generation's q, k and v; gate
    and up) as one engine call, x quantized once and one job of the pool: the same bits as
    the separate products (gemm_rows_shared_x). None where a node is not such a product."""
    x = srcs[0][0]
    if not 2 <= len(nodes) <= SHARED_X_MAX or not f32_contiguous(x) or x.ndim < 1:
        return None
    K = x.shape[-1]
    rows = x.size // max(K, 1)
    if not 1 <= rows <= engine.DOT_MAX_M or K % 32 != 0:
        return None
    pointers, ints, kernels = [x], [], set()
    for t, out, (a, w) in zip(nodes, outs, srcs):
        attrs = t.attrs
        if (a is not x or not isinstance(w, BlockTensor) or not w.computes_on_blocks
                or attrs["trans_a"] or not attrs["trans_b"] or attrs.get("scale_a", 1.0) != 1.0
                or not f32_contiguous(out) or np.may_share_memory(out, x)):
            return None
        weight = w.weight()
        if weight.K != K or out.size != rows * weight.N:
            return None
        pointers += [out, weight.data]
        ints += [engine.FORMATS.index(weight.fmt), weight.row_bytes, weight.N]
        kernels.add(weight.few_rows_kernel)
    if len(kernels) != 1:
        return None
    return Call("matmul_blocks_shared_x", pointers, [len(nodes), K, rows, kernels.pop()] + ints)
