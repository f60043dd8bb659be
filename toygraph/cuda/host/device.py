"""The host device: the CUDA backend's kernels executed on the CPU.

:class:`HostContext` has the interface of driver.Context (memory, copies, launches, graph
capture), with host memory as "device" memory and a g++-built library of the kernel
module (compiler.py) as the loaded module; a launch runs the kernel's body with the given
grid and block through the fibers of host_shim.h. So the unchanged lowering and backend
run whole graphs on the CPU:

>>> Session(graph, backend="cuda")    # with TOYGRAPH_CUDA_DEVICE=host   # doctest: +SKIP

:func:`run_kernel` launches one kernel over numpy buffers, for testing a kernel alone.

Allocations start filled with 0xFF bytes (NaN as f32, -1 as int), like the undefined
contents of fresh device memory, so reading memory nothing wrote shows up; each is followed
by 64 guard bytes, checked at every sync (each download), so a kernel writing past the end
of an allocation is a CudaError there (not within one allocation, e.g. the arena).
"""
from __future__ import annotations

import ctypes
import os
import time
from functools import lru_cache

import numpy as np

from toygraph import environment
from toygraph.cuda.host.compiler import build_library
from toygraph.errors import CudaError

_GUARD = bytes([0xA5]) * 64

#: The architecture the host executor stands in for: the kernels' sm_80 features
#: (bf16/tf32 mma.sync) are emulated.
HOST_ARCH = "sm_80"
#: The SMs it stands in for (split-K's target, ops/lowering/device.py): an H100/H200 SXM's,
#: so the host runs the launches that GPU runs.
HOST_SM_COUNT = 132


def schedule() -> str:
    """``$TOYGRAPH_HOST_SCHEDULE``: "forward" (default) runs the threads of a block first to
    last between barriers, "reverse" last to first. Race-free kernels give bit-identical
    results either way (tests/cuda/test_cuda_host_training.py checks)."""
    return environment.get("TOYGRAPH_HOST_SCHEDULE")


@lru_cache(maxsize=8)
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.tg_host_error.restype = ctypes.c_char_p
    return lib


class HostModule:
    """A loaded host library of a kernel module; functions looked up by kernel name."""

    def __init__(self, source: str, opt: str | None = None):
        self.lib = _load(str(build_library(source, opt)))
        self._functions: dict[str, object] = {}
        self.lib.tg_host_set_schedule(int(schedule() == "reverse"))

    def function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            try:
                fn = getattr(self.lib, f"tg_host_launch_{name}")
            except AttributeError:
                raise CudaError(f"no kernel {name!r} in the host module") from None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            fn.kernel = name
            self._functions[name] = fn
        return fn

    def launch(self, fn, grid, block, shmem: int, params: np.ndarray) -> None:
        dims = np.array([*grid, *block], np.int32)
        if fn(dims.ctypes.data, int(shmem), params.ctypes.data) != 0:
            raise CudaError(f"host launch failed: {self.lib.tg_host_error().decode()}")


class HostGraph:
    """A captured launch sequence, replayed in order."""

    def __init__(self, ctx: "HostContext", launches: list):
        self.ctx, self.launches = ctx, launches

    def launch(self) -> None:
        for args in self.launches:
            if callable(args):  # a collective (HostContext.enqueue)
                args(None)
            else:
                self.ctx.launch(*args)

    def destroy(self) -> None:
        self.launches = []


class _HostTimer:
    """A timing event: the host clock when it was recorded (launches run synchronously)."""
    seconds = 0.0


class HostContext:
    """driver.Context's interface over host memory; everything runs synchronously."""

    name = "host"

    def __init__(self):
        self.arch, self.sm_count = HOST_ARCH, HOST_SM_COUNT
        self._mem: dict[int, tuple] = {}   # address -> (owning array, its guard bytes)
        self._capture: list | None = None
        self._module: HostModule | None = None

    def make_current(self):
        pass

    def load_module(self, source: str) -> HostModule:
        self._module = HostModule(source)
        return self._module

    # --- memory ---------------------------------------------------------------------------
    def mem_info(self) -> tuple[int, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total

    def alloc(self, nbytes: int) -> int:
        n = max(int(nbytes), 1)
        buf = np.full(n + 64 + len(_GUARD), 0xFF, np.uint8)
        addr = (buf.ctypes.data + 63) & ~63   # aligned like cuMemAlloc's (256 there)
        start = addr - buf.ctypes.data + n
        guard = buf[start:start + len(_GUARD)]
        guard[:] = 0xA5
        self._mem[addr] = (buf, guard)
        return addr

    def free(self, dptr: int) -> None:
        self._check_guards()
        if self._mem.pop(int(dptr), None) is None:
            raise CudaError(f"free of {int(dptr):#x}: not a host-device allocation")

    def _check_guards(self) -> None:
        for addr, (buf, guard) in self._mem.items():
            if guard.tobytes() != _GUARD:
                size = guard.ctypes.data - addr
                raise CudaError(f"a kernel wrote past the end of the {size}-byte host-device "
                                f"allocation at {addr:#x} (caught at the next sync)")

    def alloc_host(self, nbytes: int) -> tuple[int, np.ndarray]:
        addr = self.alloc(nbytes)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(addr))
        return addr, view

    free_host = free

    def htod(self, dptr: int, host: np.ndarray, nbytes: int | None = None) -> None:
        n = host.nbytes if nbytes is None else nbytes
        ctypes.memmove(int(dptr), host.ctypes.data, int(n))

    def dtoh(self, host: np.ndarray, dptr: int, nbytes: int | None = None) -> None:
        n = host.nbytes if nbytes is None else nbytes
        ctypes.memmove(host.ctypes.data, int(dptr), int(n))

    def memset(self, dptr: int, value: int, nbytes: int) -> None:
        ctypes.memset(int(dptr), int(value) & 0xFF, int(nbytes))

    def sync(self) -> None:
        self._check_guards()

    # --- events: nothing is asynchronous ----------------------------------------------------
    def event(self):
        return None

    def record(self, event) -> None:
        if isinstance(event, _HostTimer):
            event.seconds = time.perf_counter()

    def wait_event(self, event) -> None:
        pass

    def timer(self):
        return _HostTimer()

    def elapsed_ms(self, start, end) -> float:
        return 1e3 * (end.seconds - start.seconds)

    # --- launches and graphs ------------------------------------------------------------
    def launch(self, fn, grid, block, shmem: int, params: np.ndarray) -> None:
        if self._capture is not None:
            self._capture.append((fn, grid, block, shmem, params))
            return
        self._module.launch(fn, grid, block, shmem, params)

    def collective(self, c):
        """Collective ``c`` (launch.Collective) over host memory, through MPI."""
        from toygraph.distributed import world_of
        w = world_of(c.ranks)
        views = [np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr))
                 for addr, n in c.buffers]
        return lambda stream: w.sum_arrays(views, c.what)

    def enqueue(self, fn) -> None:
        if self._capture is not None:
            self._capture.append(fn)
            return
        fn(None)

    def capture(self, record_launches) -> HostGraph:
        """The launches ``record_launches()`` makes, recorded instead of run."""
        self._capture = []
        try:
            record_launches()
            return HostGraph(self, self._capture)
        finally:
            self._capture = None


def by_value(packed: np.ndarray) -> "_ByValue":
    """Mark an array as a by-value kernel argument (a packed struct such as
    launch.strided(...)) for :func:`run_kernel`, which otherwise passes arrays by address."""
    return _ByValue(np.ascontiguousarray(packed))


class _ByValue:
    def __init__(self, packed):
        self.packed = packed


def run_kernel(name: str, grid, block, args, shared_bytes: int = 0,
               source: str | None = None) -> None:
    """Launch kernel ``name`` of ``source`` (default: the whole f32+tensor-core module) on
    the CPU. ``args`` in the kernel's parameter order: a numpy array is a pointer to its
    data (written in place), a numpy scalar (np.int32(3), np.float32(0.5)...) a value,
    ``by_value(array)`` a struct passed by value.

    >>> run_kernel("tg_scale", (1, 1, 1), (256, 1, 1),
    ...            [out, x, np.int32(x.size), np.float32(2.0)])   # doctest: +SKIP
    """
    from toygraph.ops.lowering.sources import backend_source
    module = HostModule(source or backend_source("bf16"))
    keep = []
    for a in args:
        if isinstance(a, np.ndarray):
            if not a.flags.c_contiguous:
                raise CudaError(f"run_kernel {name}: buffer arguments must be C-contiguous")
            keep.append(np.array([a.ctypes.data], np.uint64))
        elif isinstance(a, _ByValue):
            keep.append(a.packed)
        elif isinstance(a, np.generic):
            keep.append(np.array([a]))
        else:
            raise CudaError(f"run_kernel {name}: argument {a!r} is neither a numpy array, "
                            "a numpy scalar nor by_value(...)")
    params = np.array([k.ctypes.data for k in keep], np.uint64)
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    module.launch(module.function(name), grid, block, shared_bytes, params)
