"""The elementwise family's engine replay (cpu.h beside this): add, sub and mul under numpy
broadcasting (either operand over leading and size-1 axes), scale, the activations
(silu, gelu, sigmoid, softcap and their backward ops) and gpt-oss's swiglu_oai(+back), on
f32 arrays."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays
from toygraph.ops.shape.cpu import broadcast_strides, walk


def _walk_call(kernel, out, a, b, floats=()):
    """out = a (op) b, b None for a unary op, as the kernel's broadcast walk; None where
    an operand does not broadcast to out's shape or the walk needs more than six axes."""
    operands = [a] if b is None else [a, b]
    if not f32_contiguous(out, *operands):
        return None
    strides = [broadcast_strides(x.shape, out.shape) for x in operands]
    if any(s is None for s in strides):
        return None
    wk = walk(out.shape, *strides)
    if wk is not None:
        return Call(kernel, [out, a, b, wk], [], list(floats), keep=[wk])


def _binary(op):
    @replays(op)
    def call(node, out, srcs, attrs):
        return _walk_call(op, out, *srcs)
    return call


for _op in ("add", "sub", "mul"):
    _binary(_op)


@replays("scale")
def _scale(node, out, srcs, attrs):
    return _walk_call("scale", out, srcs[0], None, [attrs["s"]])


#: cpu.h's EwAct, in order: the ops its ``activation`` kernel computes.
ACTIVATIONS = ("silu", "silu_back", "gelu", "gelu_back", "sigmoid", "sigmoid_back", "softcap",
               "softcap_back")


def same_shape(out, srcs) -> bool:
    """Whether ``out`` and every source are contiguous f32 arrays of one shape."""
    return f32_contiguous(out, *srcs) and all(s.shape == out.shape for s in srcs)


def elementwise_replays(ops, floats=lambda attrs: ()):
    """Register ``op -> Call(op, [out, *srcs], [n], floats(attrs))`` for each of ``ops``:
    kernels of operands of one shape (the preference and policy families' too)."""
    def register(op):
        @replays(op)
        def call(node, out, srcs, attrs):
            if same_shape(out, srcs):
                return Call(op, [out, *srcs], [out.size], list(floats(attrs)))
    for op in ops:
        register(op)


def _activation(op):
    @replays(op)
    def call(node, out, srcs, attrs):
        if same_shape(out, srcs):
            g = srcs[1] if len(srcs) == 2 else None
            return Call("activation", [out, srcs[0], g], [out.size, ACTIVATIONS.index(op)],
                        [attrs.get("cap", 0.0)])
    return call


for _op in ACTIVATIONS:
    _activation(_op)


elementwise_replays(["swiglu_oai"], lambda attrs: (attrs["alpha"], attrs["limit"]))


@replays("swiglu_oai_back")
def _swiglu_oai_back(node, out, srcs, attrs):
    if same_shape(out, srcs):
        return Call("swiglu_oai_back", [out, *srcs], [out.size, attrs["wrt"]],
                    [attrs["alpha"], attrs["limit"]])
