"""Which activations the CUDA backend keeps in bf16 at ``--precision bf16``.

Every graph tensor is f32 in the DSL, and the numpy backend computes in f32 (or f64).
At bf16 the matmuls read bf16 operands anyway (tc_gemm.cu's copies round every f32
operand before the GEMM), so an activation whose every reader is such a product, or a
kernel that loads it through ``tg_ldx`` (common.cuh), loses nothing more by being
*stored* in bf16 -- and its maker writes half the bytes, its readers read half, and the
GEMM's rounding copy disappears. This module picks those tensors: a planned intermediate
(not an input, const, param, state or output) whose maker's lowering declares
``bf16_writes`` and whose every reader declares the operand in ``bf16_reads``
(registry.py). A view of it (a reshape, contiguous or unpack the buffer plan makes a view,
core/buffer_plan.py) is the same bytes, so its readers count as the tensor's; an unpack view is
only possible when its offset stays 256-byte aligned at 2 bytes an element.

Everything else -- the residual stream, reductions, the loss, weights, gradients of
weights, the optimizer's moments -- stays f32, and at "f32" / "tf32" nothing changes.

It also picks the products another node computes inside its own kernel
(:func:`plan_absorbed`, the lowerings' ``absorbs`` rule: a LoRA projection's base product
x W^T, summed with s u B^T in one accumulation by matmul_add's dual GEMM), which then get
neither launches nor a buffer.

>>> storage = plan_storage(schedule, pinned, "bf16")           # doctest: +SKIP
>>> plan = plan_buffers(schedule, pinned, 4, storage=storage)  # doctest: +SKIP
"""
from __future__ import annotations

from toygraph import environment
from toygraph.core.buffer_plan import ALIGN, Storage, is_planned, view_offset, views
from toygraph.ops.groups import VIEW, member
from toygraph.ops.lowering.registry import REGISTRY


def plan_storage(schedule, pinned: set[int], precision: str) -> Storage:
    """The bf16 tensors and absorbed products of ``schedule`` at ``precision`` (none of
    either with TOYGRAPH_CUDA_BF16_ACTIVATIONS=0 / TOYGRAPH_CUDA_DUAL_GEMM=0)."""
    half = (plan_bf16(schedule, pinned, precision)
            if environment.get("TOYGRAPH_CUDA_BF16_ACTIVATIONS") else frozenset())
    absorbed = (plan_absorbed(schedule, pinned, precision)
                if environment.get("TOYGRAPH_CUDA_DUAL_GEMM") else {})
    return Storage(half, absorbed)


def plan_absorbed(schedule, pinned: set[int], precision: str) -> dict:
    """{id of a tensor: the node computing it in its own launches}: what a node's
    ``absorbs`` rule offers, when it is a planned intermediate that node alone reads."""
    readers: dict[int, list] = {}
    for node in schedule:
        for s in node.srcs:
            readers.setdefault(s.id, []).append(node)
    absorbed = {}
    for node in schedule:
        entry = REGISTRY.get(node.op) if node.op else None
        inner = entry.absorbs(node, precision) if entry and entry.absorbs else None
        if (inner is not None and is_planned(inner, pinned) and inner.id not in absorbed
                and all(r is node for r in readers.get(inner.id, []))):
            absorbed[inner.id] = node
    return absorbed

#: The precision whose activations may be stored in bf16.
BF16_STORAGE_PRECISION = "bf16"


def plan_bf16(schedule, pinned: set[int], precision: str) -> frozenset[int]:
    """The ids of the tensors of ``schedule`` to keep in bf16 (see the module docstring)."""
    if precision != BF16_STORAGE_PRECISION:
        return frozenset()
    root = views(schedule, pinned, 4)
    members: dict[int, list] = {}      # buffer id -> it and its views
    for t in schedule:
        members.setdefault(root.get(t.id, t.id), []).append(t)
    readers: dict[int, list] = {}      # tensor id -> [(reader, source index)]
    for node in schedule:
        for i, s in enumerate(node.srcs):
            readers.setdefault(s.id, []).append((node, i))
    half: set[int] = set()
    for t in schedule:
        if t.id in root or not _writes_bf16(t, pinned):
            continue
        group = members[t.id]
        if all(_viewable(m) for m in group[1:]) and all(
                reader.id in root or _reads_bf16(reader, i)
                for m in group for reader, i in readers.get(m.id, [])):
            half.update(m.id for m in group)
    return frozenset(half)


def _writes_bf16(t, pinned) -> bool:
    entry = REGISTRY.get(t.op) if t.op else None
    return bool(entry and entry.bf16_writes and t.dtype == "f32" and is_planned(t, pinned))


def _reads_bf16(node, index: int) -> bool:
    entry = REGISTRY.get(node.op)
    return bool(entry and entry.reads_bf16(node, index))


def _viewable(view) -> bool:
    """A view of a bf16 buffer stays a view: its element offset is 256-byte aligned in bf16."""
    return member(view.op, VIEW) and view_offset(view) * 2 % ALIGN == 0
