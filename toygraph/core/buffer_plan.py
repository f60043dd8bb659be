"""Liveness-based buffer planning, shared by every backend.

Intermediates live in one arena; each gets a byte offset, and two intermediates share
bytes when their lifetimes (from the node that makes one to its last reader in the
schedule) do not overlap. Inputs, consts, params, state and outputs are pinned: they get
buffers of their own and are never reused.

A ``reshape`` or ``contiguous`` of an arena intermediate (every buffer is contiguous, so
its bytes are the result's) and an ``unpack`` of one at an ALIGN-aligned offset get no
buffer: each is a view of its source's bytes, whose life then lasts to the view's last
reader. So reshapes copy nothing, and a node that packs several results (attention_back,
glu_back) hands them out with no copy.

Buffers hold the backend's float type (``itemsize`` bytes an element), except where the
backend's :class:`Storage` says otherwise (the CUDA backend at --precision bf16,
cuda/bf16_storage.py): tensors in ``bf16`` take 2 bytes an element (a view of one is bf16 too),
and a tensor in ``absorbed`` gets no buffer at all -- the one node that reads it computes
it inside its own kernel, so that node reads the absorbed node's sources instead, and
their lives last to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import numpy as np

from toygraph.ops.groups import VIEW, member
from toygraph.ops.table import in_place

ALIGN = 256  # bytes; what CUDA's allocator guarantees, and harmless for numpy


class Storage(NamedTuple):
    """How a backend stores a schedule's intermediates besides its float type: ``bf16`` the
    ids kept in bf16, ``absorbed`` {id: the node that computes it in its own kernel}."""
    bf16: frozenset = frozenset()
    absorbed: Mapping = {}


@dataclass
class BufferPlan:
    offsets: dict[int, int] = field(default_factory=dict)  # tensor id -> arena byte offset
    arena_bytes: int = 0     # bytes the arena needs with reuse
    naive_bytes: int = 0     # bytes the same intermediates need with no reuse
    pinned_bytes: int = 0    # inputs, consts, params, state and outputs
    # The numpy backend's frozen base in block formats (core/frozen_base.py): "decode"
    # (f32 copies, counted in pinned_bytes) or "quantized" (its block bytes, base_bytes,
    # read through the decode scratch); "" when the graph has no such const.
    base_memory: str = ""
    base_bytes: int = 0      # the block-format consts: f32 copies, or their block bytes
    scratch_bytes: int = 0   # the one buffer just-in-time decodes write into
    quantized: frozenset = frozenset()   # ids of the consts kept in their block format
    bf16: frozenset = frozenset()        # ids of the intermediates kept in bf16 (CUDA)
    absorbed: Mapping = field(default_factory=dict)   # id -> the node computing it (CUDA)

    @property
    def total_bytes(self) -> int:
        """Everything the plan holds from realize on (quantized base bytes included)."""
        extra = self.base_bytes + self.scratch_bytes if self.base_memory == "quantized" else 0
        return self.arena_bytes + self.pinned_bytes + extra

    def summary(self) -> str:
        mib = 1 / (1 << 20)
        text = (f"arena {self.arena_bytes * mib:.1f} MiB (no reuse: {self.naive_bytes * mib:.1f} MiB), "
                f"pinned {self.pinned_bytes * mib:.1f} MiB")
        if self.base_memory == "decode":
            text += f" (of which the base decoded to f32: {self.base_bytes * mib:.1f} MiB)"
        elif self.base_memory == "quantized":
            text += (f", base kept quantized {self.base_bytes * mib:.1f} MiB + decode scratch "
                     f"{self.scratch_bytes * mib:.1f} MiB")
        return text

    def report(self) -> dict:
        """The plan's bytes by kind (for events.jsonl and benchmarks)."""
        return {"arena_bytes": self.arena_bytes, "naive_bytes": self.naive_bytes,
                "pinned_bytes": self.pinned_bytes, "base_memory": self.base_memory,
                "base_bytes": self.base_bytes, "scratch_bytes": self.scratch_bytes,
                "total_bytes": self.total_bytes}


def aligned(n: int) -> int:
    """``n`` bytes rounded up to the ALIGN boundary every buffer starts on."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_planned(t, pinned: set[int]) -> bool:
    """Whether ``t`` is an intermediate that lives in the arena."""
    return t.role is None and not in_place(t.op) and t.id not in pinned


def view_offset(t) -> int:
    """The element offset of view op ``t``'s bytes in its source's."""
    return t.attrs["offset"] if t.op == "unpack" else 0


def views(schedule, pinned: set[int], itemsize: int, half=frozenset()) -> dict[int, int]:
    """{view id: id of the buffer it reads} for the ops of the view group (ops/groups.py)
    planned as views (see above)."""
    root: dict[int, int] = {}
    for t in schedule:
        if not member(t.op, VIEW) or not is_planned(t, pinned):
            continue
        src = t.srcs[0]
        size = 2 if src.id in half else itemsize
        if src.dtype == t.dtype and is_planned(src, pinned) and \
                view_offset(t) * size % ALIGN == 0:
            root[t.id] = root.get(src.id, src.id)
    return root


def plan_buffers(schedule, pinned: set[int], itemsize: int, pinned_bytes: int = 0,
                 storage: Storage = Storage()) -> BufferPlan:
    """First-fit placement of every arena tensor of ``schedule`` by liveness, as
    ``storage`` says (only planned intermediates may be bf16 or absorbed)."""
    half, absorbed = storage.bf16, storage.absorbed
    root = views(schedule, pinned, itemsize, half)
    position = {t.id: i for i, t in enumerate(schedule)}
    inside: dict[int, list] = {}       # node id -> the nodes it absorbs
    for t in schedule:
        if t.id in absorbed:
            inside.setdefault(absorbed[t.id].id, []).append(t)
    last_use: dict[int, int] = {}
    for i, t in enumerate(schedule):
        reader = position[absorbed[t.id].id] if t.id in absorbed else i
        for s in t.srcs:
            last_use[root.get(s.id, s.id)] = max(last_use.get(root.get(s.id, s.id), -1), reader)
    plan = BufferPlan(pinned_bytes=pinned_bytes, bf16=frozenset(half), absorbed=dict(absorbed))
    live: list[tuple[int, int, int]] = []  # (offset, size, tensor id), sorted by offset
    for i, t in enumerate(schedule):
        if t.id in root:  # a view: its source's bytes from the offset on
            step = 2 if t.srcs[0].id in half else itemsize
            plan.offsets[t.id] = plan.offsets[t.srcs[0].id] + view_offset(t) * step
        elif is_planned(t, pinned) and t.id not in absorbed:
            size = aligned(max(1, t.size) * (2 if t.id in half else itemsize))
            offset = _first_fit(live, size)
            live.append((offset, size, t.id))
            live.sort()
            plan.offsets[t.id] = offset
            plan.naive_bytes += size
            plan.arena_bytes = max(plan.arena_bytes, offset + size)
        # Free after placing the output: a kernel reads its inputs while writing it (and
        # those of the nodes it absorbs).
        dead = {root.get(s.id, s.id) for s in t.srcs}
        dead |= {root.get(s.id, s.id) for a in inside.get(t.id, ()) for s in a.srcs}
        dead = {d for d in dead if last_use.get(d) == i}
        if is_planned(t, pinned) and t.id not in root and t.id not in last_use:
            dead.add(t.id)  # computed but never read
        live = [blk for blk in live if blk[2] not in dead]
    return plan


def _first_fit(live, size: int) -> int:
    cursor = 0
    for offset, length, _ in live:
        if offset - cursor >= size:
            return cursor
        cursor = max(cursor, offset + length)
    return cursor


def nbytes(t, itemsize: int) -> int:
    return int(np.prod(t.shape, dtype=np.int64)) * itemsize
