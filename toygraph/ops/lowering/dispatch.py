"""Lowering: one graph node -> the kernel launches that compute it, looked up in the
lowering registry (registry.py) that the op family modules of ``toygraph.ops`` fill
with ``@lowers`` entries. This module knows no op and imports none: it checks and
dispatches.

Everything shape-dependent is worked out on the host, once, at realize: strides for
broadcasting, permutes, grouped-query sharing and reductions are packed into the
``Strided`` struct of include/common.cuh, and every scalar is a fixed-width numpy value
(np.int32 / np.float32 / np.float64, pointers np.uint64), never a Python int or float.

>>> launches = lower(node, ptr_of, scratch_ptr)     # doctest: +SKIP
>>> [l.kernel for l in launches]                    # doctest: +SKIP
['tg_ce_rows', 'tg_ce_reduce']

Consts whose ids are in ``raw_consts`` live on the device in their GGUF block format; their
consumers must be ones :func:`reads_block_format` accepts (each op's ``block_format`` rule:
a 2-D weight as a matmul's b with trans_a=False, the fused head's weight, a get_rows table).
"""
from __future__ import annotations

from toygraph.ops.lowering.launch import Launch
from toygraph.ops.lowering.registry import REGISTRY, At, block_storage, cuda_op
from toygraph.errors import CudaError


def scratch_bytes(node, precision: str = "f32") -> int:
    """Device scratch a node needs besides its output (filled by its own launches) at the
    backend's ``precision``: a scratch rule taking two arguments is given the precision
    (the tensor-core attention stages bf16 operand copies there)."""
    rule = cuda_op(node.op, node.name).scratch
    if rule is None:
        return 0
    return rule(node, precision) if rule.__code__.co_argcount == 2 else rule(node)


def reads_block_format(node, index: int) -> bool:
    """Whether ``node`` can read its source ``index`` (a const of 2 or more dims in a
    block_storage() format: a weight, or stacked experts) in its block format; which
    operands may is each op's registry rule."""
    src = node.srcs[index]
    if src.role != "const" or src.storage not in block_storage() or len(src.shape) < 2:
        return False
    entry = REGISTRY.get(node.op)
    return bool(entry and entry.block_format and entry.block_format(node, index))


def lower(node, ptr, scratch: int = 0, raw_consts=frozenset(), precision: str = "f32",
          bf16=frozenset(), absorbed=None) -> list[Launch]:
    """The launches computing ``node``; ``ptr(t)`` is the device address of tensor t (for a
    const in ``raw_consts``, the address of its block bytes). ``precision`` "bf16"/"tf32":
    the matmul and attention lowerings pick their tensor-core kernels (gemm/cuda.py and
    flash_attention/cuda.py say which, and when); no other op looks at it. ``bf16``: ids of
    the tensors kept in bf16 (cuda/bf16_storage.py), which only an entry declaring it may read
    or write (a view the buffer plan made of a bf16 buffer launches nothing, so it reads
    and writes no bf16 itself); ``absorbed``: {id: node} of the tensors another node's
    launches compute (no launches of their own)."""
    entry = cuda_op(node.op, node.name)
    absorbed = absorbed or {}
    if node.id in absorbed:
        return []
    for i, src in enumerate(node.srcs):
        if src.id in raw_consts and not reads_block_format(node, i):
            raise CudaError(f"{node.op} {node.name!r} cannot read const {src.name!r} in its "
                            f"{src.storage} block format")
    out = ptr(node) if entry.has_output else 0
    launches = entry.build(node, At(out, ptr, scratch, raw_consts, precision, entry.kernels,
                                    frozenset(bf16), absorbed))
    if launches:
        for i, src in enumerate(node.srcs):
            if src.id in bf16 and not entry.reads_bf16(node, i):
                raise CudaError(f"{node.op} {node.name!r} cannot read {src.name!r} in bf16")
        if node.id in bf16 and not entry.bf16_writes:
            raise CudaError(f"{node.op} {node.name!r} cannot write its output in bf16")
    return launches
