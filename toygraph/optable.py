"""The op table itself: one OpSpec per op name, and the helpers the op modules build it
with (ops.py for the plain ops, ops_fused.py for the ops whose kernels are fused).

A backward rule gets the node, the gradient of its output and a list saying which sources
need a gradient; it returns one gradient Tensor (or None) per source, built from more ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import GraphError

F32, I32, NONE = "f32", "i32", "none"
INT32_MAX = 2 ** 31 - 1
#: What a label must index (the id range check's wording for cross-entropy labels).
LABELS = "the vocabulary (or -1 to ignore)"


@dataclass(frozen=True)
class OpSpec:
    name: str
    infer: Callable       # (shapes, dtypes, attrs) -> (shape, dtype); raises GraphError
    grad: Callable | None  # (node, gout, need) -> [grad or None per src]
    # For ops that index with integer operands: {src index: (low, high, what)}, the range
    # [low, high) those values must lie in. Sessions check uploads against it, so a bad
    # id is a clear error on the host, never an out-of-bounds read in a kernel.
    id_ranges: Callable | None = None  # (node) -> dict[int, tuple[int, int, str]]


OPS: dict[str, OpSpec] = {}


def define_op(name, infer, grad=None, id_ranges=None):
    OPS[name] = OpSpec(name, infer, grad, id_ranges)


def check(cond, msg):
    """A shape/dtype rule's condition: GraphError(msg) when it fails (the graph prefixes
    the op and its operands)."""
    if not cond:
        raise GraphError(msg)


def check_floats(dtypes, n=None):
    for i, d in enumerate(dtypes if n is None else dtypes[:n]):
        check(d == F32, f"operand {i} must be f32, got {d}")


def make_node(op, srcs, **attrs):
    return srcs[0].graph.node(op, srcs, attrs)
