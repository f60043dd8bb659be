"""CUDA lowering of the pointwise ops (elementwise.cu): broadcasting binary ops, scale and
the activations with their backward ops."""
from __future__ import annotations

from .launch import Launch, _blocks, _pad, contiguous_strides, f32, i32, p, strided
from .registry import lowers

#: tg_binary's op code per op.
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2}


def broadcast_strides(src_shape, out_shape) -> list[int]:
    """Strides walking ``src_shape`` broadcast to ``out_shape`` (0 on broadcast axes)."""
    src = _pad(src_shape, len(out_shape))
    cs = contiguous_strides(src)
    return [0 if s == 1 and o != 1 else c for s, o, c in zip(src, out_shape, cs)]


@lowers("add", "sub", "mul", kernels=("tg_binary",))
def _binary(node, at):
    a, b = node.srcs
    n = node.size
    sa = broadcast_strides(a.shape, node.shape)
    sb = broadcast_strides(b.shape, node.shape)
    return [Launch("tg_binary", _blocks(n), [p(at.out), p(at.ptr(a)), p(at.ptr(b)), i32(n),
                                               strided(node.shape, sa, sb),
                                               i32(BINARY_CODES[node.op])])]


@lowers("scale", kernels=("tg_scale",))
def _scale(node, at):
    n = node.size
    return [Launch("tg_scale", _blocks(n),
                   [p(at.out), p(at.ptr(node.srcs[0])), i32(n), f32(node.attrs["s"])])]


def _unary(kernel, node, at):
    n = node.size
    return [Launch(kernel, _blocks(n), [p(at.out), p(at.ptr(node.srcs[0])), i32(n)])]


def _unary_back(kernel, node, at):
    x, g = node.srcs
    n = node.size
    return [Launch(kernel, _blocks(n), [p(at.out), p(at.ptr(x)), p(at.ptr(g)), i32(n)])]


@lowers("silu", kernels=("tg_silu",))
def _silu(node, at):
    return _unary("tg_silu", node, at)


@lowers("silu_back", kernels=("tg_silu_back",))
def _silu_back(node, at):
    return _unary_back("tg_silu_back", node, at)


@lowers("gelu", kernels=("tg_gelu",))
def _gelu(node, at):
    return _unary("tg_gelu", node, at)


@lowers("gelu_back", kernels=("tg_gelu_back",))
def _gelu_back(node, at):
    return _unary_back("tg_gelu_back", node, at)
