"""CUDA lowering of the collective op (ops_collective.py): ``all_reduce``.

Its launch sequence is a :class:`Collective` (not a kernel: the context enqueues it on the
session's stream, a real GPU as one ``ncclAllReduce`` per buffer in an NCCL group, see
nccl.py; the host device through MPI) followed by a ``tg_copy`` of the summed count into
the node's output. Both go on the one stream, so graph capture records them like any
launch and the replayed step includes the reduction.
"""
from __future__ import annotations

from dataclasses import dataclass

from .launch import Launch, i32, p
from .registry import lowers


@dataclass(frozen=True)
class Collective:
    """An in-place sum over ``ranks`` ranks of f32 device buffers ``(address, count)``."""
    buffers: tuple[tuple[int, int], ...]
    ranks: int
    what: str = "the all-reduce of the step's gradients"


@lowers("all_reduce", kernels=("tg_copy",))
def _all_reduce(node, at):
    buffers = tuple((at.ptr(s), s.size) for s in node.srcs)
    return [Collective(buffers, node.attrs["ranks"]),
            Launch("tg_copy", (1, 1, 1), [p(at.out), p(at.ptr(node.srcs[0])), i32(1)])]
