"""Elementwise ops: add/sub/mul (numpy broadcasting), scale, silu, gelu (tanh), sigmoid and
softcap with their backward ops, the composite mean, and
gpt-oss's clamped SwiGLU (swiglu_oai). Each op's
builder, shape rule, backward rule, numpy kernel and CUDA lowering (elementwise.cu).
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.shape import broadcast_shapes
from toygraph.core.ops.shape import sum as _sum
from toygraph.core.ops.shape import sum_to
from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, contiguous_strides, declare_kernels, f32_arg, grid_1d,
                                    i32_arg, lowers, pad_shape, ptr_arg, strided)
from toygraph.errors import GraphError

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "elementwise.cu")


# --- builders and rules ------------------------------------------------------------------------
def _infer_binary(shapes, dtypes, attrs):
    check_floats(dtypes)
    return broadcast_shapes(shapes[0], shapes[1]), F32


def add(a, b):
    return make_node("add", [a, b])


def sub(a, b):
    return make_node("sub", [a, b])


def mul(a, b):
    return make_node("mul", [a, b])


def scale(x, s: float):
    return make_node("scale", [x], s=float(s))


def mean(x, axis=None):
    """sum(x, axis) / the number of elements summed."""
    n = x.size if axis is None else x.shape[axis]
    return scale(_sum(x, axis), 1.0 / n)


define_op("add", _infer_binary, lambda n, g, need: [sum_to(g, s.shape) for s in n.srcs])
define_op("sub", _infer_binary,
    lambda n, g, need: [sum_to(g, n.srcs[0].shape), sum_to(scale(g, -1.0), n.srcs[1].shape)])
define_op("mul", _infer_binary, lambda n, g, need: [
    sum_to(mul(g, n.srcs[1]), n.srcs[0].shape) if need[0] else None,
    sum_to(mul(g, n.srcs[0]), n.srcs[1].shape) if need[1] else None])


def infer_unary(shapes, dtypes, attrs):
    """The rule of an op whose f32 output has its one operand's shape."""
    check_floats(dtypes)
    return shapes[0], F32


define_op("scale", infer_unary, lambda n, g, need: [scale(g, n.attrs["s"])])


def silu(x):
    return make_node("silu", [x])


def silu_back(x, g):
    return make_node("silu_back", [x, g])


def infer_same2(shapes, dtypes, attrs):
    """The rule of a backward op of two f32 operands of one shape (x and its gradient)."""
    check_floats(dtypes)
    check(shapes[0] == shapes[1], f"shapes must match, got {shapes[0]} and {shapes[1]}")
    return shapes[0], F32


define_op("silu", infer_unary, lambda n, g, need: [silu_back(n.srcs[0], g)])
define_op("silu_back", infer_same2)


def gelu(x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), exactly
    torch's ``gelu(approximate="tanh")`` (Hugging Face's ``gelu_pytorch_tanh``, Gemma)."""
    return make_node("gelu", [x])


def gelu_back(x, g):
    return make_node("gelu_back", [x, g])


define_op("gelu", infer_unary, lambda n, g, need: [gelu_back(n.srcs[0], g)])
define_op("gelu_back", infer_same2)


def sigmoid(x):
    """1 / (1 + exp(-x)): Qwen3.5's gates (the attention output gate, DeltaNet's beta)."""
    return make_node("sigmoid", [x])


def sigmoid_back(x, g):
    return make_node("sigmoid_back", [x, g])


define_op("sigmoid", infer_unary, lambda n, g, need: [sigmoid_back(n.srcs[0], g)])
define_op("sigmoid_back", infer_same2)


def softcap(x, cap: float):
    """cap * tanh(x / cap): Gemma's final-logit soft capping (logits stay in (-cap, cap))."""
    if not cap > 0:
        raise GraphError(f"softcap needs a positive cap, got {cap}")
    return make_node("softcap", [x], cap=float(cap))


def softcap_back(x, g, cap: float):
    return make_node("softcap_back", [x, g], cap=cap)


define_op("softcap", infer_unary,
          lambda n, g, need: [softcap_back(n.srcs[0], g, n.attrs["cap"])])
define_op("softcap_back", infer_same2)
def swiglu_oai(gate, up, *, alpha: float = 1.702, limit: float = 7.0):
    """gpt-oss's clamped SwiGLU: g * sigmoid(alpha * g) * (u + 1) with g = min(gate, limit)
    and u = clamp(up, -limit, limit) (transformers' GptOssExperts._apply_gate, llama.cpp's
    ggml_swiglu_oai). Clamped inputs get no gradient, as torch.clamp gives none."""
    return make_node("swiglu_oai", [gate, up], alpha=float(alpha), limit=float(limit))


def _grad_swiglu_oai(n, g, need):
    return [make_node("swiglu_oai_back", [*n.srcs, g], wrt=i, **n.attrs) if need[i] else None
            for i in (0, 1)]


define_op("swiglu_oai", infer_same2, _grad_swiglu_oai)
define_op("swiglu_oai_back", lambda s, d, a: infer_same2(s[:2], d[:2], a))


# --- numpy kernels -----------------------------------------------------------------------------
@kernel("add")
def _add_numpy(out, srcs, attrs):
    np.add(srcs[0], srcs[1], out=out)


@kernel("sub")
def _sub_numpy(out, srcs, attrs):
    np.subtract(srcs[0], srcs[1], out=out)


@kernel("mul")
def _mul_numpy(out, srcs, attrs):
    np.multiply(srcs[0], srcs[1], out=out)


@kernel("scale")
def _scale_numpy(out, srcs, attrs):
    np.multiply(srcs[0], out.dtype.type(attrs["s"]), out=out)


@kernel("silu")
def _silu_numpy(out, srcs, attrs):
    x = srcs[0]
    # x / (1 + exp(-x)): exp overflows to inf for x < -88 and the quotient is then the
    # correct limit -0, so the overflow warning is silenced rather than branched around.
    with np.errstate(over="ignore"):
        np.exp(-x, out=out)
    out += 1
    np.divide(x, out, out=out)


@kernel("silu_back")
def _silu_back_numpy(out, srcs, attrs):
    x, g = srcs
    with np.errstate(over="ignore"):
        s = np.exp(-x)
    s += 1
    np.reciprocal(s, out=s)                 # sigmoid(x)
    np.subtract(1, s, out=out)
    out *= x
    out += 1                                # 1 + x (1 - s)
    out *= s
    out *= g


# GELU, tanh approximation (torch's approximate="tanh"): 0.5 x (1 + tanh(c (x + a x^3))).
_GELU_C, _GELU_A = np.sqrt(2.0 / np.pi), 0.044715


def _gelu_tanh(x):
    return np.tanh(x.dtype.type(_GELU_C) * (x + x.dtype.type(_GELU_A) * x * x * x))


@kernel("gelu")
def _gelu_numpy(out, srcs, attrs):
    x = srcs[0]
    np.multiply(x, 0.5 * (1 + _gelu_tanh(x)), out=out)


@kernel("gelu_back")
def _gelu_back_numpy(out, srcs, attrs):
    """d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), t = tanh(c (x + a x^3))."""
    x, g = srcs
    t = _gelu_tanh(x)
    c, a = x.dtype.type(_GELU_C), x.dtype.type(3 * _GELU_A)
    out[...] = g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + a * x * x))


def _sigmoid(x):
    """As tg_sigmoid computes it: exp of -|x| only, so neither side overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


@kernel("sigmoid")
def _sigmoid_numpy(out, srcs, attrs):
    out[...] = _sigmoid(srcs[0])


@kernel("sigmoid_back")
def _sigmoid_back_numpy(out, srcs, attrs):
    """d/dx = s (1 - s)."""
    x, g = srcs
    s = _sigmoid(x)
    out[...] = g * s * (1 - s)


@kernel("softcap")
def _softcap_numpy(out, srcs, attrs):
    """In place in ``out`` (the same operations as tanh(x / c) * c): the Gemma 4 head's
    logits are [tokens, 262144], where temporaries cost more than the tanh."""
    c = srcs[0].dtype.type(attrs["cap"])
    np.divide(srcs[0], c, out=out)
    np.tanh(out, out=out)
    np.multiply(out, c, out=out)


@kernel("softcap_back")
def _softcap_back_numpy(out, srcs, attrs):
    """d/dx = 1 - t^2, t = tanh(x / cap); one temporary (``out`` may share g's memory)."""
    x, g = srcs
    t = np.divide(x, x.dtype.type(attrs["cap"]))
    np.tanh(t, out=t)
    np.multiply(t, t, out=t)
    np.subtract(1, t, out=t)
    np.multiply(g, t, out=out)
def _swiglu_oai_parts(gate, up, attrs):
    """(clamped gate, clamped up, sigmoid(alpha * clamped gate))."""
    gc = np.minimum(gate, gate.dtype.type(attrs["limit"]))
    uc = np.clip(up, -attrs["limit"], attrs["limit"]).astype(up.dtype)
    with np.errstate(over="ignore"):
        s = 1 / (1 + np.exp(-gate.dtype.type(attrs["alpha"]) * gc))
    return gc, uc, s


@kernel("swiglu_oai")
def _swiglu_oai_numpy(out, srcs, attrs):
    gc, uc, s = _swiglu_oai_parts(*srcs, attrs)
    out[...] = gc * s * (uc + 1)


@kernel("swiglu_oai_back")
def _swiglu_oai_back_numpy(out, srcs, attrs):
    """d gate = g (u + 1) (s + alpha g s (1 - s)) where gate <= limit; d up = g * glu where
    |up| <= limit."""
    gate, up, g = srcs
    gc, uc, s = _swiglu_oai_parts(gate, up, attrs)
    limit = attrs["limit"]
    if attrs["wrt"] == 0:
        out[...] = np.where(gate <= limit, g * (uc + 1) * (s + attrs["alpha"] * gc * s * (1 - s)), 0)
    else:
        out[...] = np.where(np.abs(up) <= limit, g * (gc * s), 0)


# --- CUDA lowering (elementwise.cu) ------------------------------------------------------------
#: tg_binary's op code per op.
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2}


def broadcast_strides(src_shape, out_shape) -> list[int]:
    """Strides walking ``src_shape`` broadcast to ``out_shape`` (0 on broadcast axes)."""
    src = pad_shape(src_shape, len(out_shape))
    cs = contiguous_strides(src)
    return [0 if s == 1 and o != 1 else c for s, o, c in zip(src, out_shape, cs)]


def vector_ok(*addrs) -> bool:
    """Whether float4 loads and stores may run at these addresses (16-byte aligned: every
    buffer is, ALIGN; a view at an odd offset would not be)."""
    return all(a % 16 == 0 for a in addrs)


def grid_vec(n: int):
    """The grid of a vectorised kernel: a thread per four elements."""
    return grid_1d((n + 3) // 4)


@lowers("add", "sub", "mul", kernels=("tg_binary", "tg_binary_vec"))
def _binary(node, at):
    """Operands of the output's shape: tg_binary_vec (float4, no index arithmetic);
    broadcasting ones: tg_binary's strided walk."""
    a, b = node.srcs
    n = node.size
    code = i32_arg(BINARY_CODES[node.op])
    if a.shape == b.shape == node.shape and vector_ok(at.out, at.ptr(a), at.ptr(b)):
        return [Launch("tg_binary_vec", grid_vec(n),
                       [ptr_arg(at.out), ptr_arg(at.ptr(a)), ptr_arg(at.ptr(b)), i32_arg(n),
                        code])]
    sa = broadcast_strides(a.shape, node.shape)
    sb = broadcast_strides(b.shape, node.shape)
    return [Launch("tg_binary", grid_1d(n), [ptr_arg(at.out), ptr_arg(at.ptr(a)),
                                             ptr_arg(at.ptr(b)), i32_arg(n),
                                             strided(node.shape, sa, sb), code])]


@lowers("scale", kernels=("tg_scale", "tg_scale_vec"))
def _scale(node, at):
    n, x = node.size, at.ptr(node.srcs[0])
    name, grid = ("tg_scale_vec", grid_vec(n)) if vector_ok(at.out, x) else ("tg_scale", grid_1d(n))
    return [Launch(name, grid, [ptr_arg(at.out), ptr_arg(x), i32_arg(n),
                                f32_arg(node.attrs["s"])])]


def pointwise(node, at):
    """One thread per element, ``out[i] = f(x[i])`` (a backward op: ``f(x[i], g[i])``),
    launching the one kernel the op's registry entry names."""
    (name,) = at.kernels
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    return [Launch(name, grid_1d(node.size), [ptr_arg(at.out), *srcs, i32_arg(node.size)])]


lowers("silu", kernels=("tg_silu",))(pointwise)
lowers("silu_back", kernels=("tg_silu_back",))(pointwise)
lowers("gelu", kernels=("tg_gelu",))(pointwise)
lowers("gelu_back", kernels=("tg_gelu_back",))(pointwise)


lowers("sigmoid", kernels=("tg_sigmoid_op",))(pointwise)
lowers("sigmoid_back", kernels=("tg_sigmoid_back",))(pointwise)


@lowers("softcap", "softcap_back", kernels=("tg_softcap", "tg_softcap_back"))
def _softcap(node, at):
    name = "tg_softcap" if node.op == "softcap" else "tg_softcap_back"
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    return [Launch(name, grid_1d(node.size), [ptr_arg(at.out), *srcs, i32_arg(node.size),
                                               f32_arg(node.attrs["cap"])])]


@lowers("swiglu_oai", "swiglu_oai_back", kernels=("tg_swiglu_oai", "tg_swiglu_oai_back"))
def _swiglu_oai(node, at):
    """Forward: tg_swiglu_oai; backward: tg_swiglu_oai_back for d gate (wrt 0) or d up."""
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    a = node.attrs
    tail = [i32_arg(node.size), f32_arg(a["alpha"]), f32_arg(a["limit"])]
    if node.op == "swiglu_oai":
        return [Launch("tg_swiglu_oai", grid_1d(node.size), [ptr_arg(at.out), *srcs, *tail])]
    return [Launch("tg_swiglu_oai_back", grid_1d(node.size),
                   [ptr_arg(at.out), *srcs, *tail, i32_arg(a["wrt"])])]
