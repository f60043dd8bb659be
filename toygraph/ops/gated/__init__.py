"""The gated FFN activations fused: ``glu`` (act(gate) * up, act SiLU for SwiGLU or tanh-GELU
for GeGLU) in one kernel instead of an activation and a mul, and ``glu_back``, one kernel
writing both gradients into one packed buffer that two ``unpack`` views hand out (the
buffer plan makes them views, core/buffer_plan.py). The numpy kernels compute exactly what the
composed ops computed, in the same f32 order, and the CUDA kernels round like the separate
ones (gated.cu), so fusing changes no bit of any result. Builders, rules, numpy kernels and
CUDA lowering.
"""
from __future__ import annotations

import numpy as np

from toygraph.ops.elementwise.numpy import (_gelu_back_numpy, _gelu_numpy, _silu_back_numpy,
                                            _silu_numpy)
from toygraph.ops.shape import unpack
from toygraph.ops.table import F32, check, check_floats, define_op, make_node

#: The activations by name: (their code in gated.cu, numpy forward, numpy backward).
ACTS = {"silu": (0, _silu_numpy, _silu_back_numpy), "gelu": (1, _gelu_numpy, _gelu_back_numpy)}


#: d up starts at a multiple of this many elements of glu_back's packed output, so its
#: view keeps the 256-byte alignment of every buffer (in bf16, f32 and f64).
PACK_ALIGN = 128


def glu(gate, up, act: str):
    """act(gate) * up in one op (``act`` one of ACTS)."""
    if act not in ACTS:
        raise ValueError(f"glu: act must be one of {sorted(ACTS)}, got {act!r}")
    return make_node("glu", [gate, up], act=act)


def swiglu(gate, up):
    """silu(gate) * up, the Llama FFN activation."""
    return glu(gate, up, "silu")


def geglu(gate, up):
    """gelu(gate) * up, the Gemma FFN activation."""
    return glu(gate, up, "gelu")


def up_offset(n: int) -> int:
    """Where d up starts in glu_back's packed output of two n-element gradients."""
    return (n + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN


def _infer_glu(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(all(s == shapes[0] for s in shapes), f"gate, up (and gradient) shapes must match, "
          f"got {' and '.join(str(tuple(s)) for s in shapes)}")
    return tuple(shapes[0]), F32


def _infer_glu_back(shapes, dtypes, attrs):
    shape, _ = _infer_glu(shapes, dtypes, attrs)
    n = int(np.prod(shape))
    return (up_offset(n) + n,), F32


def _grad_glu(n, g, need):
    """d gate and d up: views into one glu_back node's output."""
    back = make_node("glu_back", [*n.srcs, g], act=n.attrs["act"])
    gate, up = n.srcs
    return [unpack(back, 0, gate.shape) if need[0] else None,
            unpack(back, up_offset(up.size), up.shape) if need[1] else None]


define_op("glu", _infer_glu, _grad_glu)
define_op("glu_back", _infer_glu_back)
