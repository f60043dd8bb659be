"""Elementwise ops: add/sub/mul (numpy broadcasting), scale, silu, gelu (tanh), sigmoid and
softcap with their backward ops, the composite mean, and
gpt-oss's clamped SwiGLU (swiglu_oai). Each op's
builder, shape rule, backward rule, numpy kernel and CUDA lowering (elementwise.cu).
"""
from __future__ import annotations

from toygraph.errors import GraphError
from toygraph.ops.shape import broadcast_shapes, sum_to
from toygraph.ops.shape import sum as _sum
from toygraph.ops.table import F32, check, check_floats, define_op, make_node


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
