"""Lowering: one graph node -> the kernel launches that compute it.

Everything shape-dependent is worked out here on the host, once, at realize: strides for
broadcasting, permutes, grouped-query sharing and reductions are packed into the
``Strided`` struct of kernels/common.cuh, and every scalar is a fixed-width numpy value
(np.int32 / np.float32 / np.float64, pointers np.uint64), never a Python int or float.

>>> launches = lower(node, ptr_of, scratch_ptr)     # doctest: +SKIP
>>> [l.kernel for l in launches]                    # doctest: +SKIP
['tg_ce_rows', 'tg_ce_reduce']

What each op does on CUDA is its entry in the registry (registry.py), declared beside its
launch builder in the family module that imports below: lower_elementwise (pointwise),
lower_layout (copies, gathers, reductions), lower_rows (norms, rope, softmax, row
gathers), lower_matmul, lower_loss, lower_fused (attention, head + loss), lower_pref
(the preference-loss ops of ops_pref.py), lower_optim and lower_cache (generation's KV
cache).
:data:`OP_KERNELS`, :func:`scratch_bytes` and :func:`reads_block_format` are read off it.

Consts whose ids are in ``raw_consts`` live on the device in their GGUF block format; their
consumers must be ones :func:`reads_block_format` accepts (a 2-D weight as a matmul's b
with trans_a=False, or a get_rows table), which lower to the fused kernels of qmatmul.cu.
"""
from __future__ import annotations

from ..errors import CudaError
from .constants import ATTN_TILES
from .kernels import DEQUANT_KERNELS
# The family modules register their ops on import; their helpers the backend, devmem and
# the tests use are re-exported from here.
from . import (lower_cache, lower_elementwise, lower_fused, lower_layout,  # noqa: F401
               lower_loss, lower_matmul, lower_optim, lower_pref, lower_rows)
from .launch import (MAX_ELEMENTS, MAX_GRID, MAX_GRID_YZ, MAXD, THREADS, Launch, collapse,
                     contiguous_strides, f32, f64, i32, p, strided)
from .lower_elementwise import broadcast_strides
from .lower_fused import attention_config, lce_chunk_rows
from .lower_layout import expand_walk, sum_to_walk
from .lower_matmul import TC_TILE, matmul_batch, row_bytes
from .registry import REGISTRY, At, cuda_op

__all__ = ["lower", "scratch_bytes", "reads_block_format", "OP_KERNELS", "BLOCK_STORAGE",
           "broadcast_strides", "expand_walk", "sum_to_walk", "MAX_ELEMENTS", "MAX_GRID",
           "MAX_GRID_YZ", "MAXD", "THREADS", "Launch", "collapse", "contiguous_strides",
           "strided", "p", "i32", "f32", "f64", "ATTN_TILES", "attention_config",
           "lce_chunk_rows", "TC_TILE", "matmul_batch", "row_bytes"]

#: The kernels each op launches (f32, dense operands; a block-format weight reads through
#: QUANT_KERNELS, bf16/tf32 matmuls through TC_KERNELS). Tests check it covers ops.OPS and
#: every name exists in the sources.
OP_KERNELS: dict[str, tuple[str, ...]] = {op: e.kernels for op, e in REGISTRY.items()}

#: Storage formats a const may keep on the device (the formats with a dequant kernel; f32
#: consts are used as they are).
BLOCK_STORAGE: tuple[str, ...] = tuple(DEQUANT_KERNELS)


def scratch_bytes(node) -> int:
    """Device scratch a node needs besides its output (filled by its own launches)."""
    rule = cuda_op(node.op, node.name).scratch
    return rule(node) if rule else 0


def reads_block_format(node, index: int) -> bool:
    """Whether ``node`` can read its source ``index`` (a 2-D const in a BLOCK_STORAGE
    format) in its block format; which operands may is each op's registry rule."""
    src = node.srcs[index]
    if src.role != "const" or src.storage not in BLOCK_STORAGE or len(src.shape) != 2:
        return False
    entry = REGISTRY.get(node.op)
    return bool(entry and entry.block_format and entry.block_format(node, index))


def lower(node, ptr, scratch: int = 0, raw_consts=frozenset(), precision: str = "f32"
          ) -> list[Launch]:
    """The launches computing ``node``; ``ptr(t)`` is the device address of tensor t (for a
    const in ``raw_consts``, the address of its block bytes). ``precision`` "bf16"/"tf32"
    lowers matmuls to the tensor-core kernels of tc_matmul.cu (same arguments, 128 x 128
    tiles); every other op, and every op at "f32", lowers as it always has."""
    entry = cuda_op(node.op, node.name)
    for i, src in enumerate(node.srcs):
        if src.id in raw_consts and not reads_block_format(node, i):
            raise CudaError(f"{node.op} {node.name!r} cannot read const {src.name!r} in its "
                            f"{src.storage} block format")
    out = ptr(node) if entry.has_output else 0
    return entry.build(node, At(out, ptr, scratch, raw_consts, precision))
