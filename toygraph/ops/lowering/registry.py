"""The CUDA lowering registry: one :class:`CudaOp` per op, and the block-format decoders.

An entry holds everything the CUDA backend knows about an op: the function that turns a
node into kernel launches, the kernels it launches (written out literally, so searching
for a kernel's name finds its lowering), the device scratch it needs besides its output,
and which of its operands may stay in their GGUF block format. Entries are declared next
to their launch builders with :func:`lowers`, in the op family modules of
``toygraph.ops`` (beside each op's rules and numpy kernel); importing those modules
fills the registry, and dispatch.py looks nodes up here. The registry itself knows no op.

>>> @lowers("scale", kernels=("tg_scale",))                  # doctest: +SKIP
... def _scale(node, at):
...     return [Launch("tg_scale", grid_1d(node.size),
...                    [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])), ...])]

:func:`decodes` registers, per GGUF block format, the launch that decodes a const stored
in it to f32 (the backend's realize runs it for a const no consumer reads in blocks); the
formats with a decoder are the ones a const may keep on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping, NamedTuple

from toygraph.errors import CudaError


class At(NamedTuple):
    """Where a node's launches read and write: ``out`` its output address (0 for an op
    with no output), ``ptr(t)`` any tensor's address (a const in ``raw_consts``: its block
    bytes), ``scratch`` the address of its scratch (:attr:`CudaOp.scratch` bytes), the
    backend's matmul ``precision`` ("f32", "bf16" or "tf32") and the ``kernels`` its entry
    declares. Every node's scratch is the same buffer (cuda/devmem.py): the launches must
    write what they read there, and nothing in it outlives the node (what a later node
    reads, such as saved row statistics, is an output). ``bf16``: the ids of the tensors
    kept in bf16 rather than f32 (cuda/bf16_storage.py; only ops whose entry declares
    ``bf16_reads`` / ``bf16_writes`` ever see one); ``absorbed``: {id: node} of the tensors
    a node computes inside its own launches (``CudaOp.absorbs``), which have no buffer."""
    out: int
    ptr: Callable
    scratch: int
    raw_consts: Collection[int]
    precision: str
    kernels: tuple[str, ...] = ()
    bf16: Collection[int] = frozenset()
    absorbed: Mapping = {}

    def half(self, t) -> bool:
        """Whether tensor ``t`` is kept in bf16."""
        return t.id in self.bf16

    def bf16_mask(self, node, srcs=None) -> int:
        """The ``bf16`` argument of a kernel that reads and writes through tg_ldx/tg_stx
        (common.cuh): bit j for operand j of ``srcs`` (default the node's sources), bit
        16 (TG_OUT_BF16) for the output."""
        srcs = node.srcs if srcs is None else srcs
        mask = sum(1 << j for j, s in enumerate(srcs) if s.id in self.bf16)
        return mask | (1 << 16 if node.id in self.bf16 else 0)


@dataclass(frozen=True)
class CudaOp:
    """How one op runs on CUDA."""
    op: str
    build: Callable                    # (node, At) -> list[Launch]
    kernels: tuple[str, ...]           # every kernel ``build`` launches in f32 on dense operands
    scratch: Callable | None = None    # node [, precision] -> bytes of scratch; None: none
    block_format: Callable | None = None  # (node, index) -> may that source stay in blocks
    has_output: bool = True            # False: the op updates its sources in place
    # --precision bf16's activations (cuda/bf16_storage.py): the source indices (negative: from
    # the end) whose tensor the launches can read in bf16, and whether they can write the
    # output in bf16; a tensor is kept in bf16 only when its maker and every reader can.
    bf16_reads: tuple[int, ...] = ()
    bf16_writes: bool = False
    # (node, precision) -> the source this node's launches can compute too (a product
    # whose only reader it is: its output then needs neither launches nor a buffer), or
    # None; cuda/bf16_storage.py checks that the source is a planned intermediate read only here.
    absorbs: Callable | None = None

    def reads_bf16(self, node, index: int) -> bool:
        n = len(node.srcs)
        return any(i % n == index for i in self.bf16_reads) if n else False


REGISTRY: dict[str, CudaOp] = {}
#: Block format -> ``launch(name, storage, out, raw, n)`` decoding n elements of const
#: ``name`` stored as ``storage`` from its block bytes at ``raw`` into f32 at ``out``.
DECODERS: dict[str, Callable] = {}


def lowers(*ops: str, kernels: tuple[str, ...], scratch=None, block_format=None,
           has_output: bool = True, bf16_reads: tuple[int, ...] = (),
           bf16_writes: bool = False, absorbs=None):
    """Register the decorated ``build(node, at)`` as the CUDA lowering of ``ops``."""
    def register(build):
        for op in ops:
            if op in REGISTRY:
                raise CudaError(f"op {op!r} has two CUDA lowerings")
            REGISTRY[op] = CudaOp(op, build, tuple(kernels), scratch, block_format, has_output,
                                  tuple(bf16_reads), bool(bf16_writes), absorbs)
        return build
    return register


def decodes(*formats: str):
    """Register the decorated ``launch(name, storage, out, raw, n)`` as the decoder of
    ``formats``."""
    def register(launch):
        for fmt in formats:
            if fmt in DECODERS:
                raise CudaError(f"block format {fmt!r} has two CUDA decoders")
            DECODERS[fmt] = launch
        return launch
    return register


def cuda_op(op: str, name: str = "") -> CudaOp:
    """The registry entry of ``op``; a CudaError naming it (and node ``name``) if none."""
    entry = REGISTRY.get(op)
    if entry is None:
        where = f" (node {name!r})" if name else ""
        raise CudaError(f"the CUDA backend has no lowering for op {op!r}{where}")
    return entry


def op_kernels() -> dict[str, tuple[str, ...]]:
    """The kernels each registered op launches (f32, dense operands; a block-format weight
    reads through its family's block kernels, bf16/tf32 matmuls through the tensor-core
    ones)."""
    return {op: e.kernels for op, e in REGISTRY.items()}


def block_storage() -> tuple[str, ...]:
    """The storage formats a const may keep on the device (those with a decoder; f32
    consts are used as they are)."""
    return tuple(DECODERS)


def decode_launch(name: str, storage: str, out: int, raw: int, n: int):
    """The launch decoding const ``name`` (``n`` elements stored as ``storage``)."""
    launch = DECODERS.get(storage)
    if launch is None:
        raise CudaError(f"const {name!r}: no CUDA dequantizer for storage {storage!r} "
                        f"(supported: f32, {', '.join(DECODERS)})")
    return launch(name, storage, out, raw, n)
