"""Device memory of a realized graph: which frozen consts stay in their GGUF block format
and what the backend allocates, worked out on the host with no device.

A const stored as f16/bf16/q8_0/q4_0/q4_1/q4_k/q5_k/q6_k whose every consumer in the
schedule reads it through a fused kernel of ops/gemm/qmatmul.cu (``x @ W^T``, ``dy @ W``, or
get_rows; see lowering.reads_block_format) keeps its block bytes on the device and gets no
f32 copy: for Q4_1 weights that is 0.625 bytes per element instead of 4 (QLoRA-style).
Any other consumer (or the const being a graph output) falls back to the f32 copy that
realize decodes with ops/gemm/dequant.cu. ``TOYGRAPH_CUDA_QMATMUL=0`` forces the fallback
for every const.

Scratch is one buffer shared by every node that needs some (``scratch_bytes``, the
largest need; ``scratch`` keeps each node's): a node's scratch lives only while its own
launches run, each launch sequence writes it before reading it, and every launch of a
session runs in schedule order on one stream (CUDA-graph replay and the all-reduce's
Collective included), so no two nodes ever use it at once.

>>> mem = plan_device_memory(schedule, plan, pinned)       # doctest: +SKIP
>>> mem.report()["saved_bytes"]                            # doctest: +SKIP
441483264
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toygraph import environment
from toygraph.ops.table import in_place
from toygraph.ops.lowering.dispatch import reads_block_format, scratch_bytes
from toygraph.ops.lowering.registry import block_storage
from toygraph.gguf import blocks


def qmatmul_enabled() -> bool:
    """False when ``TOYGRAPH_CUDA_QMATMUL=0`` asks for f32 copies of every const."""
    return environment.get("TOYGRAPH_CUDA_QMATMUL")


def block_format_consts(schedule, outputs=()) -> set[int]:
    """Ids of the consts of ``schedule`` that every consumer reads in their block format
    (and that are not among ``outputs``, which are downloaded as f32)."""
    out_ids = {t.id for t in outputs}
    candidates = {t.id for t in schedule if t.role == "const" and t.storage in block_storage()
                  and len(t.shape) >= 2 and t.id not in out_ids}
    used: set[int] = set()
    for node in schedule:
        for i, src in enumerate(node.srcs):
            if src.id in candidates:
                used.add(src.id)
                if not reads_block_format(node, i):
                    candidates.discard(src.id)
    return candidates & used


@dataclass
class DeviceMemoryPlan:
    """Every device allocation realize makes, in bytes."""
    arena_bytes: int = 0
    f32_buffers: dict[int, int] = field(default_factory=dict)   # pinned tensor id -> bytes
    raw_consts: dict[int, int] = field(default_factory=dict)    # block-format const -> bytes
    scratch: dict[int, int] = field(default_factory=dict)       # node id -> bytes it needs
    dequant_temp_bytes: int = 0   # transient at realize: the largest const decoded to f32
    f32_avoided_bytes: int = 0    # the f32 copies the raw consts would have needed

    @property
    def scratch_bytes(self) -> int:
        """The one scratch buffer every node shares: the largest node's need."""
        return max(self.scratch.values(), default=0)

    @property
    def resident_bytes(self) -> int:
        """Bytes held from realize until close."""
        return (self.arena_bytes + sum(self.f32_buffers.values()) + sum(self.raw_consts.values())
                + self.scratch_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.dequant_temp_bytes

    @property
    def saved_bytes(self) -> int:
        """Resident bytes saved against f32 copies of the block-format consts."""
        return self.f32_avoided_bytes - sum(self.raw_consts.values())

    def report(self) -> dict:
        return {"arena_bytes": self.arena_bytes,
                "f32_pinned_bytes": sum(self.f32_buffers.values()),
                "block_format_consts": len(self.raw_consts),
                "block_format_bytes": sum(self.raw_consts.values()),
                "scratch_bytes": self.scratch_bytes, "scratch_nodes": len(self.scratch),
                "scratch_shared_saved_bytes": sum(self.scratch.values()) - self.scratch_bytes,
                "dequant_temp_bytes": self.dequant_temp_bytes,
                "resident_bytes": self.resident_bytes, "peak_bytes": self.peak_bytes,
                "f32_avoided_bytes": self.f32_avoided_bytes, "saved_bytes": self.saved_bytes}


def plan_device_memory(schedule, plan, pinned, outputs=(), qmatmul: bool | None = None,
                       precision: str = "f32") -> DeviceMemoryPlan:
    """The allocations of CudaBackend.realize for ``schedule`` with the shared buffer
    ``plan``: the arena, one f32 (or i32) buffer per pinned tensor except the consts kept in
    block format, which get their block bytes instead, and one scratch buffer for all the
    nodes that need scratch (each node's need at the backend's ``precision`` in
    ``scratch``)."""
    if qmatmul is None:
        qmatmul = qmatmul_enabled()
    raw = block_format_consts(schedule, outputs) if qmatmul else set()
    mem = DeviceMemoryPlan(arena_bytes=plan.arena_bytes)
    for t in schedule:
        if t.id not in pinned or in_place(t.op):
            continue
        f32 = 4 * max(t.size, 1)
        if t.id in raw:
            mem.raw_consts[t.id] = blocks.nbytes(t.storage, t.shape)
            mem.f32_avoided_bytes += f32
        else:
            mem.f32_buffers[t.id] = f32
            if t.role == "const" and t.storage not in ("f32", "f64") and t.data is not None:
                mem.dequant_temp_bytes = max(mem.dequant_temp_bytes,
                                             int(np.asarray(t.data).nbytes))
    for t in schedule:
        if t.op is not None:
            n = scratch_bytes(t, precision)
            if n:
                mem.scratch[t.id] = n
    return mem
