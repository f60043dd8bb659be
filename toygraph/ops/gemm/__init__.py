"""matmul: batched, broadcast and grouped-query products, with a frozen weight that may
stay in its GGUF block format on CUDA; matmul_add: add + alpha * matmul, the product with
an epilogue. Builder, shape rule, backward rule, numpy kernel
and CUDA lowering: f32 tiles (matmul.cu), weights read in block format (qmatmul.cu),
tensor-core tiles for tf32 and for block-format weights at bf16 (tc_matmul.cu +
tc_layout.cuh), the bf16 GEMM with cp.async, ldmatrix and split-K for dense operands
(tc_gemm.cu, lowered by tc_gemm.py), and the dequantizers the CUDA backend decodes the
other block-format consts with at realize (dequant.cu).
"""
from __future__ import annotations

from toygraph.ops.elementwise import scale
from toygraph.ops.shape import broadcast_shapes, sum_to
from toygraph.ops.table import F32, check, check_floats, define_op, make_node


def matmul(a, b, *, trans_a=False, trans_b=False, scale_a: float = 1.0):
    """a @ b over the last two axes, batch axes broadcast. ``b`` may have fewer heads
    than ``a`` (grouped-query attention); a 2-D ``b`` is a weight shared by every batch.
    ``scale_a``: (scale_a * a) @ b, a rounded to f32 after the scale as a scale node would
    round it (LoRA's backward: s dy read by dB and du without a pass of its own; the bf16
    GEMM's operand copy applies it)."""
    return make_node("matmul", [a, b], **_attrs(trans_a, trans_b, scale_a))


def _attrs(trans_a, trans_b, scale_a: float) -> dict:
    """A product's attributes; scale_a only where it is not 1 (most graphs never see it)."""
    attrs = dict(trans_a=bool(trans_a), trans_b=bool(trans_b))
    if scale_a != 1.0:
        attrs["scale_a"] = float(scale_a)
    return attrs


def matmul_add(add, a, b, *, alpha: float = 1.0, trans_a=False, trans_b=False,
               scale_a: float = 1.0):
    """add + alpha * (a @ b), ``add`` of the product's shape: LoRA's y = x W^T + s (x A^T) B^T
    and the sums of gradient contributions, with the add (and scale) in the product's
    epilogue instead of two more passes over the output. Rounded as matmul, scale and add
    would round it: the same bits. The product's operands are the last two sources, as a
    matmul's are (the helpers below read ``srcs[-2:]``), and ``add`` comes first so the
    graph's order, and with it the order autodiff sums contributions in, is the unfused
    add's."""
    return make_node("matmul_add", [add, a, b], alpha=float(alpha),
                     **_attrs(trans_a, trans_b, scale_a))


def _mat_dims(shape, trans):
    m, k = shape[-2], shape[-1]
    return (k, m) if trans else (m, k)


def _infer_matmul(shapes, dtypes, attrs):
    check_floats(dtypes)
    a, b = shapes[-2:]
    check(len(a) >= 2 and len(b) >= 2, f"matmul needs >= 2-D operands, got {a} and {b}")
    m, k = _mat_dims(a, attrs["trans_a"])
    k2, n = _mat_dims(b, attrs["trans_b"])
    check(k == k2, f"inner dimensions differ: {k} vs {k2}")
    batch = broadcast_shapes(a[:-2], b[:-2], allow_groups=True)
    check(len(b) == 2 or len(a) >= len(b), "b may not have more batch axes than a")
    return batch + (m, n), F32


def _infer_matmul_add(shapes, dtypes, attrs):
    shape, dtype = _infer_matmul(shapes, dtypes, attrs)
    check(tuple(shapes[0]) == shape, f"the added operand {shapes[0]} is not the product's "
                                     f"shape {shape}")
    return shape, dtype


def _grad_matmul(n, g, need, g_scale: float = 1.0):
    """dA and dB of the product, for the gradient ``g_scale * g``."""
    (a, b), ta, tb = n.srcs[-2:], n.attrs["trans_a"], n.attrs["trans_b"]
    s_a = n.attrs.get("scale_a", 1.0)
    if s_a == 1.0:
        return _product_grads(a, b, ta, tb, g, need, g_scale)
    # A product that scales its own a is made by autodiff, so only a second backward
    # reaches here: the unfused graph's gradient (scale node, product, scale), its bits.
    ga, gb = _product_grads(scale(a, s_a), b, ta, tb, g, need, g_scale)
    return [None if ga is None else scale(ga, s_a), gb]


def _product_grads(a, b, ta, tb, g, need, g_scale: float):
    """dA and dB of a @ b (transposed as ta, tb) for the gradient ``g_scale * g``: a product
    that reads g as its first operand scales it there (scale_a), one that reads it second
    from a scale node, made once."""
    scaled = []

    def g_second():     # g scaled, as the second operand of a product
        if g_scale == 1.0:
            return g
        if not scaled:
            scaled.append(scale(g, g_scale))
        return scaled[0]
    ga = gb = None
    if need[0]:  # dA = dC B^T (or its transpose when A was transposed)
        ga = (matmul(b, g_second(), trans_a=tb, trans_b=True) if ta else
              matmul(g, b, trans_b=not tb, scale_a=g_scale))
        ga = sum_to(ga, a.shape)
    if need[1]:
        if b.ndim == 2 and a.ndim > 2 and not ta:
            # A weight shared by every batch row: fold the batch axes into M so dB is one
            # 2-D matmul instead of a per-batch product summed afterwards.
            af = a.reshape(-1, a.shape[-1])
            gb = (matmul(g.reshape(-1, g.shape[-1]), af, trans_a=True, scale_a=g_scale) if tb
                  else matmul(af, g_second().reshape(-1, g.shape[-1]), trans_a=True))
        else:  # dB = A^T dC (or its transpose)
            gb = (matmul(g, a, trans_a=True, trans_b=ta, scale_a=g_scale) if tb else
                  matmul(a, g_second(), trans_a=not ta))
            gb = sum_to(gb, b.shape)
    return [ga, gb]


def _grad_matmul_add(n, g, need):
    """The add's gradient is g; the product's is matmul's of alpha * g, scaled where its
    products read it (scale_a: LoRA's du and dB read s dy with no scale pass), rounded as
    the unfused graph's scale node rounds it: the same bits."""
    return [g if need[0] else None] + _grad_matmul(n, g, need[1:], n.attrs["alpha"])


def _fold_add_matmul(node, other):
    """node + other as one matmul_add: autodiff sums a gradient's contributions in the
    product's epilogue (dx = dy W + du A of a LoRA projection, q/k/v's shared input)."""
    if other.shape != node.shape or other.dtype != node.dtype:
        return None
    return matmul_add(other, *node.srcs, **node.attrs)


define_op("matmul", _infer_matmul, _grad_matmul, fold_add=_fold_add_matmul)
define_op("matmul_add", _infer_matmul_add, _grad_matmul_add)
