"""How the numpy backend holds a frozen base stored in a block format (f16, bf16, q8_0,
q4_k...): kept in its block bytes and computed on by the CPU engine (QLoRA on the CPU), or
decoded to f32 once at realize.

- ``quantized``: the const stays as its GGUF bytes (an mmap of the file: 1.1 GB for a
  Llama-3.2-1B in q8_0, where f32 copies would take 4.1 GB). A node whose op has a block
  kernel serving it (``ops.BLOCK_KERNELS``) reads the bytes itself: matmul and matmul_add
  multiply on the blocks through the CPU engine (toygraph/cpu/: each thread decodes a
  panel of the weight into its cache right before the product on it, so no f32 copy of
  the weight exists), get_rows decodes only the rows it gathers, expert_matmul only the
  experts some token chose. Forward, backward (dx through the frozen weight) and
  recomputed blocks alike: the mechanism sees nodes, not what they are for. Any other node
  reading a quantized const (a DoRA norm of W + s BA, an f64 gradient check, the engine
  missing) gets it decoded into the *decode scratch* first, one buffer the size of the
  largest such need, and its plain kernel reads that.
- ``decode``: realize decodes each such const to an f32 array it keeps (4 bytes a weight)
  and BLAS multiplies it: numpy's reference arithmetic, which the golden runs record.
- ``auto`` (the default): ``quantized`` when the CPU engine computes on every such const's
  blocks (it runs at the decoded step's speed: bench/cpu_engine.py); without the engine,
  ``decode`` when the whole decoded plan takes at most ``AUTO_SHARE`` of the memory
  available now, else ``quantized``.

The engine's products sum in their own order (one fused multiply-add chain per output, the
same whatever the threads), BLAS in its own: the two modes agree to f32 rounding, not bit
for bit (tests/cpu/test_cpu_gemm.py states the bound; tests/core/test_frozen_base.py the losses).

The mode is ``Session(base_memory=...)``, else ``$TOYGRAPH_BASE_MEMORY``. The decision
and its bytes land in the BufferPlan (its summary is the realize line). Before it
allocates anything the backend checks the plan against the memory available and refuses
in one line a plan that cannot fit (:func:`check_fits`).

>>> plan_base(schedule, plan, pinned, outputs, "quantized", itemsize=4)   # doctest: +SKIP
>>> plan.summary()                                                        # doctest: +SKIP
'arena 319.2 MiB (...), pinned 16.8 MiB, base kept quantized 462.7 MiB'
"""
from __future__ import annotations

from toygraph import environment
from toygraph.core.buffer_plan import BufferPlan, aligned, nbytes
from toygraph.ops.table import BLOCK_KERNELS
from toygraph.cpu import engine
from toygraph.errors import GraphError
from toygraph.gguf import blocks
from toygraph.limits import limit_words, usable_memory

MODES = ("auto", "decode", "quantized")
#: Without the CPU engine, ``auto`` decodes the base only when the decoded plan leaves a
#: quarter of the available memory to the rest of the machine (and to the transients of
#: loading).
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
    """What this process may still allocate: the least of the machine's MemAvailable, the
    address-space limit and the cgroup's (toygraph/limits.py); None where none is known."""
    usable = usable_memory()
    return None if usable is None else usable[0]


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
    _, reads, need, serves = BLOCK_KERNELS.get(node.op, (None, (), None, None))
    mine = [s for i, s in enumerate(node.srcs) if s.id in quantized]
    if not mine:
        return {}, 0
    if all(i in reads for i, s in enumerate(node.srcs) if s.id in quantized) \
            and serves(node, itemsize):
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
    if mode == "auto" and itemsize == 4 and all(engine.available(t.storage) for t in consts):
        mode = "quantized"
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
    """GraphError, in one line, when ``plan`` holds more than this process may allocate now."""
    available = available_bytes() if available is None else available
    if available is None or plan.total_bytes <= available:
        return
    gib = 1 / (1 << 30)
    hint = ("; TOYGRAPH_BASE_MEMORY=quantized keeps the base in its block format"
            if plan.base_memory == "decode" else "")
    raise GraphError(f"this plan needs {plan.total_bytes * gib:.2f} GiB ({plan.summary()}) but "
                     f"this process has {available * gib:.2f} GiB available{limit_words()}{hint}; "
                     "a smaller batch or sequence, or activation checkpointing, shrinks the arena")
