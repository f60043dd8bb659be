"""The CUDA lowering registry: one :class:`CudaOp` per op of ops.OPS.

An entry holds everything the CUDA backend knows about an op: the function that turns a
node into kernel launches, the kernels it launches (written out literally, so searching
for a kernel's name finds its lowering), the device scratch it needs besides its output,
and which of its operands may stay in their GGUF block format. Entries are declared next
to their launch builders with :func:`lowers`, in the op family modules of
``toygraph.ops`` (beside each op's rules and numpy kernel); importing ``toygraph.ops``
fills the registry, and lowering.py looks ops up here.

>>> @lowers("scale", kernels=("tg_scale",))                  # doctest: +SKIP
... def _scale(node, at):
...     return [Launch("tg_scale", _blocks(node.size), [p(at.out), p(at.ptr(node.srcs[0])), ...])]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, NamedTuple

from ..errors import CudaError


class At(NamedTuple):
    """Where a node's launches read and write: ``out`` its output address (0 for an op
    with no output), ``ptr(t)`` any tensor's address (a const in ``raw_consts``: its block
    bytes), ``scratch`` the address of its scratch (:attr:`CudaOp.scratch` bytes), and the
    backend's matmul ``precision`` ("f32", "bf16" or "tf32"). Every node's scratch is the
    same buffer (cuda/devmem.py): the launches must write what they read there, and nothing
    in it outlives the node (what a later node reads, such as saved row statistics, is an
    output)."""
    out: int
    ptr: Callable
    scratch: int
    raw_consts: Collection[int]
    precision: str


@dataclass(frozen=True)
class CudaOp:
    """How one op runs on CUDA."""
    op: str
    build: Callable                    # (node, At) -> list[Launch]
    kernels: tuple[str, ...]           # every kernel ``build`` launches in f32 on dense operands
    scratch: Callable | None = None    # node -> bytes of scratch; None: none
    block_format: Callable | None = None  # (node, index) -> may that source stay in blocks
    has_output: bool = True            # False: the op updates its sources in place


REGISTRY: dict[str, CudaOp] = {}


def lowers(*ops: str, kernels: tuple[str, ...], scratch=None, block_format=None,
           has_output: bool = True):
    """Register the decorated ``build(node, at)`` as the CUDA lowering of ``ops``."""
    def register(build):
        for op in ops:
            if op in REGISTRY:
                raise CudaError(f"op {op!r} has two CUDA lowerings")
            REGISTRY[op] = CudaOp(op, build, tuple(kernels), scratch, block_format, has_output)
        return build
    return register


def cuda_op(op: str, name: str = "") -> CudaOp:
    """The registry entry of ``op``; a CudaError naming it (and node ``name``) if none."""
    entry = REGISTRY.get(op)
    if entry is None:
        where = f" (node {name!r})" if name else ""
        raise CudaError(f"the CUDA backend has no lowering for op {op!r}{where}")
    return entry
