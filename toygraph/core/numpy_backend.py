"""The numpy backend: buffers from the shared plan, one kernel call per scheduled node. The
kernels are the ops' own (``ops.KERNELS``, each in its family module of toygraph/core/ops/)."""
from __future__ import annotations

import numpy as np

from toygraph.core.memory import BufferPlan
from toygraph.core.ops import KERNELS
from toygraph.errors import GraphError

DTYPES = {"f32": np.float32, "f64": np.float64}


def const_array(t, dtype) -> np.ndarray:
    """A const's value as a float array: f32 mmap'd data is used in place, anything stored
    in another format (f16, bf16, quantized blocks) is dequantized once."""
    data = np.asarray(t.data)
    if t.storage == "f32":  # raw GGUF bytes or an array: either way no copy is made here
        arr = (data.view(np.float32) if data.dtype == np.uint8 else data).reshape(t.shape)
    else:
        from toygraph.gguf import blocks  # only models with quantized consts need it
        arr = blocks.dequantize(data, t.storage, t.shape)
    return arr if arr.dtype == dtype else arr.astype(dtype)


class CpuBackend:
    name = "cpu"

    def __init__(self, dtype: str = "f32"):
        if dtype not in DTYPES:
            raise GraphError(f"cpu backend dtype must be f32 or f64, got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.itemsize = np.dtype(self.dtype).itemsize
        self.arrays: dict[int, np.ndarray] = {}

    def realize(self, graph, schedule, plan: BufferPlan, pinned: set[int]):
        missing = [n.op for n in schedule if n.op is not None and n.op not in KERNELS]
        if missing:
            raise GraphError(f"cpu backend has no kernel for ops {sorted(set(missing))}")
        self.arena = np.zeros(max(plan.arena_bytes, 1), np.uint8)
        for t in schedule:
            if t.role == "const":
                self.arrays[t.id] = const_array(t, self.dtype)
            elif t.role == "param":
                self.arrays[t.id] = np.array(t.data, self.dtype).reshape(t.shape)
            elif t.role in ("input", "state") or t.id in pinned:
                dt = np.int32 if t.dtype == "i32" else self.dtype
                self.arrays[t.id] = np.zeros(t.shape, dt)
            elif t.id in plan.offsets:  # an i32 result (topk's ids) fits in its f32/f64 slot
                off = plan.offsets[t.id]
                dt = np.dtype(np.int32 if t.dtype == "i32" else self.dtype)
                view = self.arena[off:off + t.size * dt.itemsize].view(dt)
                self.arrays[t.id] = view.reshape(t.shape)
        self.schedule = schedule

    def run(self, nodes):
        arrays = self.arrays
        for t in nodes:
            if t.op is None:
                continue
            srcs = [arrays[s.id] for s in t.srcs]
            KERNELS[t.op](arrays.get(t.id), srcs, t.attrs)

    def write(self, t, value: np.ndarray):
        np.copyto(self.arrays[t.id], value, casting="unsafe")

    def read(self, t) -> np.ndarray:
        return np.array(self.arrays[t.id])

    def zero(self, t):
        self.arrays[t.id].fill(0)
