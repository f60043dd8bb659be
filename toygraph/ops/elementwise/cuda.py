"""The CUDA lowering of the elementwise family (kernels in elementwise.cu; its ops and their rules
are in __init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import (Launch, contiguous_strides, declare_kernels, f32_arg, grid_1d,
                                   i32_arg, lowers, pad_shape, ptr_arg, strided)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "elementwise.cu")


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
