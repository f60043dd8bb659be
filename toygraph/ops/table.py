"""The op tables every family module of toygraph.ops fills, and the helpers it fills them
with: ``OPS`` (one :class:`OpSpec` per op: shape/dtype rule, backward rule, id ranges) via
:func:`define_op`, which also enters the op in its groups (groups.py), and ``KERNELS`` (the
numpy kernel per op) via :func:`kernel`. The CUDA lowering of each op is entered in the
third table, ``toygraph.ops.lowering.registry.REGISTRY``, with ``@lowers`` in the same
family module.

A backward rule gets the node, the gradient of its output and a list saying which sources
need a gradient; it returns one gradient Tensor (or None) per source, built from more ops.
An op whose one flat result packs several (the ``packed`` group: attention's o and its row
log-sum-exp) is read through ``unpack`` views, so its rule gets {view offset: gradient}
instead, for the views that have one.
A numpy kernel is ``kernel(out, srcs, attrs)`` and writes into ``out`` (``None`` for an op
that updates its sources in place); ``block_kernel`` registers a variant that reads a
frozen const in its block format (``BLOCK_KERNELS``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from toygraph.ops import groups as op_groups
from toygraph.errors import GraphError

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
    # For a backward op that can add another tensor in its own kernel: (node, other) -> a
    # node computing node + other in one pass (rms_norm_back), which autodiff uses to sum
    # a gradient's contributions without an add kernel.
    fold_add: Callable | None = None
    # The op groups it is in (groups.py: views, pass-through, in place, packed results).
    groups: frozenset = frozenset()


OPS: dict[str, OpSpec] = {}
KERNELS: dict[str, Callable] = {}
#: Numpy kernels that read some sources in their block format themselves, per op:
#: (kernel, the source indices it takes as ``toygraph.cpu.block_tensor.BlockTensor``s, the scratch
#: elements it needs for a node, whether it serves a node: ``when(node, itemsize)``). The
#: numpy backend calls one for a node whose every quantized source is at such an index and
#: that it serves (matmul multiplies on the blocks through the CPU engine, get_rows decodes
#: only the rows it gathers, expert_matmul only the experts some token chose); any other
#: node gets its quantized sources decoded into the scratch first (core/frozen_base.py).
BLOCK_KERNELS: dict[str, tuple[Callable, tuple[int, ...], Callable, Callable]] = {}


def define_op(name, infer, grad=None, id_ranges=None, fold_add=None, groups=()):
    """Enter op ``name`` in the op table (each name once), and in the op ``groups`` it
    belongs to (groups.py)."""
    if name in OPS:
        raise GraphError(f"op {name!r} is defined twice")
    op_groups.join(name, groups)
    OPS[name] = OpSpec(name, infer, grad, id_ranges, fold_add, frozenset(groups))


def in_place(op: str | None) -> bool:
    """Whether ``op`` writes into its sources instead of producing a value (the in-place
    group: accumulate, adamw): such a node has no buffer of its own."""
    return op_groups.member(op, op_groups.IN_PLACE)


def kernel(name):
    """Register the decorated ``fn(out, srcs, attrs)`` as op ``name``'s numpy kernel."""
    def register(fn):
        KERNELS[name] = fn
        return fn
    return register


def block_kernel(name, reads: tuple[int, ...], scratch: Callable = lambda node: 0,
                 when: Callable = lambda node, itemsize: True):
    """Register the decorated ``fn(out, srcs, attrs, scratch)`` as op ``name``'s numpy
    kernel for sources ``reads`` kept in their block format (see BLOCK_KERNELS);
    ``scratch(node)`` elements of the decode scratch are its to decode into (a flat array,
    or None when it asks for none); ``when(node, itemsize)`` says whether it serves a node
    whose buffers have ``itemsize`` bytes an element (else the node's blocks are decoded
    into the scratch and its plain kernel runs)."""
    def register(fn):
        BLOCK_KERNELS[name] = (fn, tuple(reads), scratch, when)
        return fn
    return register


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
