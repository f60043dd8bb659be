"""How the numpy backend holds a frozen base stored in a block format (f16, bf16, q8_0,
q4_k...): decoded to f32 once at realize, or kept in its block bytes and decoded just in
time by every node that reads it (QLoRA on the CPU).

- ``decode``: realize decodes each such const to an f32 array it keeps (4 bytes a weight:
  Llama-3.2-1B's 1.04e9 base weights are 4.1 GB whatever the file holds). Fastest.
- ``quantized``: the const stays as its GGUF bytes (an mmap of the file: 1.1 GB for that
  1B model in q8_0). Before a node that reads one runs, the backend decodes it into the
  *decode scratch*, one buffer the size of the largest node's need, and the node's kernel
  reads the scratch: the same values in the same GEMMs, so results are bit-identical.
  A node whose op has a block kernel for that source (``ops.BLOCK_KERNELS``: get_rows
  decodes only the rows it gathers) reads the bytes itself and needs no scratch. Forward,
  backward (dx through the frozen weight) and recomputed blocks alike: the mechanism sees
  nodes, not what they are for, so any op reading any frozen block-format const works
  unchanged. expert_matmul's block kernel decodes only the experts some token chose in
  this step, one at a time into one expert's worth of scratch: the other experts' pages
  of the mapped file are never read.
- ``auto``: ``decode`` when the whole decoded plan takes at most ``AUTO_SHARE`` of the
  memory available now, else ``quantized``.

The mode is ``Session(base_memory=...)``, else ``$TOYGRAPH_BASE_MEMORY``. The decision
and its bytes land in the BufferPlan (its summary is the realize line). Before it
allocates anything the backend checks the plan against the memory available and refuses
in one line a plan that cannot fit (:func:`check_fits`).

>>> plan_base(schedule, plan, pinned, outputs, "quantized", itemsize=4)   # doctest: +SKIP
>>> plan.summary()                                                        # doctest: +SKIP
'arena 1637.2 MiB (...), pinned 10.1 MiB, base kept quantized 1054.2 MiB + decode scratch 250.0 MiB'
"""
from __future__ import annotations

from toygraph import environment
from toygraph.core.buffer_plan import BufferPlan, aligned, nbytes
from toygraph.core.ops.table import BLOCK_KERNELS
from toygraph.errors import GraphError
from toygraph.gguf import blocks

MODES = ("auto", "decode", "quantized")
#: ``auto`` decodes the base only when the decoded plan leaves a quarter of the available
#: memory to the rest of the machine (and to the transients of loading).
AUTO_SHARE = 0.75
_FLOAT_STORAGE = ("f32", "f64")


def resolve_mode(mode: str | None) -> str:
    """``mode``, else ``$TOYGRAPH_BASE_MEMORY``; a GraphError names a bad value."""
    if mode is None:
        return environment.get("TOYGRAPH_BASE_MEMORY")
    if mode not in MODES:
        raise GraphError(f"base_memory must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), or None
    where it is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def block_format_consts(schedule, outputs=()) -> list:
    """The consts of ``schedule`` whose data is stored in a block format (not f32), and
    that are not among ``outputs`` (a download wants the f32 value)."""
    out_ids = {t.id for t in outputs}
    return [t for t in schedule if t.role == "const" and t.storage not in _FLOAT_STORAGE
            and t.data is not None and t.id not in out_ids]


def scratch_layout(node, quantized, itemsize: int) -> tuple[dict[int, int], int]:
    """Where in the scratch ``node``'s quantized sources are decoded ({const id: byte
    offset}, in source order) and the bytes that takes; ({}, 0) when the node reads none,
    and ({}, what its block kernel asks for) when it reads all of them in their block
    format through its op's block kernel."""
    _, reads, need = BLOCK_KERNELS.get(node.op, (None, (), None))
    mine = [s for i, s in enumerate(node.srcs) if s.id in quantized]
    if not mine:
        return {}, 0
    if all(i in reads for i, s in enumerate(node.srcs) if s.id in quantized):
        return {}, aligned(need(node) * itemsize)
    layout, offset = {}, 0
    for s in mine:
        if s.id not in layout:
            layout[s.id] = offset
            offset += aligned(nbytes(s, itemsize))
    return layout, offset


def plan_base(schedule, plan: BufferPlan, pinned, outputs, mode: str | None, itemsize: int,
              available: int | None = None) -> BufferPlan:
    """Choose how the block-format consts of ``schedule`` are held and record it in
    ``plan`` (whose pinned_bytes counted them as f32 so far). ``available`` defaults to
    :func:`available_bytes` (it only matters for ``auto``)."""
    mode = resolve_mode(mode)
    consts = block_format_consts(schedule, outputs)
    if not consts:
        return plan
    f32_bytes = sum(nbytes(t, itemsize) for t in consts)
    ids = frozenset(t.id for t in consts)
    scratch = max((scratch_layout(t, ids, itemsize)[1] for t in schedule if t.op is not None),
                  default=0)
    if mode == "auto":
        available = available_bytes() if available is None else available
        fits = available is None or plan.arena_bytes + plan.pinned_bytes <= AUTO_SHARE * available
        mode = "decode" if fits else "quantized"
    plan.base_memory = mode
    if mode == "decode":
        plan.base_bytes = f32_bytes
        return plan
    plan.pinned_bytes -= f32_bytes
    plan.base_bytes = sum(blocks.nbytes(t.storage, t.shape) for t in consts)
    plan.scratch_bytes = scratch
    plan.quantized = ids
    return plan


def check_fits(plan: BufferPlan, available: int | None = None) -> None:
    """GraphError, in one line, when ``plan`` holds more than the memory available now."""
    available = available_bytes() if available is None else available
    if available is None or plan.total_bytes <= available:
        return
    gib = 1 / (1 << 30)
    hint = ("; TOYGRAPH_BASE_MEMORY=quantized keeps the base in its block format"
            if plan.base_memory == "decode" else "")
    raise GraphError(f"this plan needs {plan.total_bytes * gib:.2f} GiB ({plan.summary()}) but "
                     f"the machine has {available * gib:.2f} GiB available{hint}; a smaller "
                     "batch or sequence, or activation checkpointing, shrinks the arena")
