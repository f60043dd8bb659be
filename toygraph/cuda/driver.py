"""A thin, checked layer over ``cuda.bindings.driver``.

Every call goes through :func:`call`, which turns a failed status into a
:class:`~toygraph.errors.CudaError` naming the driver function and the CUDA error name.
The bindings are imported lazily, so importing this module (and the backend) works on a
machine without ``cuda-bindings``; using it there raises CudaError.

>>> from toygraph.cuda import driver
>>> if driver.available():                    # doctest: +SKIP
...     ctx = driver.Context()
...     buf = ctx.alloc(1024); ctx.memset(buf, 0, 1024); ctx.sync()
"""
from __future__ import annotations

import ctypes

import numpy as np

from toygraph.errors import CudaError

_cu = None
_initialised = False


def bindings():
    """The ``cuda.bindings.driver`` module, or CudaError saying how to get it."""
    global _cu
    if _cu is None:
        try:
            from cuda.bindings import driver as cu
        except Exception as e:  # ImportError, or a broken install
            raise CudaError("the CUDA backend needs cuda-bindings: "
                            "pip install 'toygraph[cuda]' "
                            f"({type(e).__name__}: {e})") from None
        _cu = cu
    return _cu


def _error_name(cu, status) -> str:
    try:
        err, name = cu.cuGetErrorName(status)
        if err == cu.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return str(status)


def call(fn_name: str, *args):
    """Call ``cuda.bindings.driver.<fn_name>(*args)``; return its results without the status.

    Returns None, the single value, or a tuple, depending on how many values follow the
    status. A failure raises CudaError("cuXxx failed: CUDA_ERROR_...").
    """
    cu = bindings()
    try:
        res = getattr(cu, fn_name)(*args)
    except CudaError:
        raise
    except Exception as e:  # the loader raises when there is no driver library at all
        raise CudaError(f"{fn_name} failed: {type(e).__name__}: {e}") from None
    status, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    if status != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{fn_name} failed: {_error_name(cu, status)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def init() -> None:
    global _initialised
    if not _initialised:
        call("cuInit", 0)
        _initialised = True


def available() -> bool:
    """Whether a CUDA driver and at least one device are usable. Never raises."""
    try:
        init()
        return int(call("cuDeviceGetCount")) > 0
    except Exception:
        return False


def device_arch(ordinal: int = 0) -> str:
    """``"sm_XY"`` of device ``ordinal``."""
    init()
    cu = bindings()
    dev = call("cuDeviceGet", ordinal)
    attr = cu.CUdevice_attribute
    major = call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return f"sm_{int(major)}{int(minor)}"


def device_sm_count(ordinal: int = 0) -> int:
    """The streaming multiprocessors of device ``ordinal``."""
    init()
    dev = call("cuDeviceGet", ordinal)
    attr = bindings().CUdevice_attribute
    return int(call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))


def ptr(p) -> int:
    """A device or host pointer (CUdeviceptr, int...) as a plain int."""
    return int(p)


class Module:
    """A loaded cubin and its functions, looked up once by name."""

    def __init__(self, image: bytes):
        self.handle = call("cuModuleLoadData", image)
        self._functions = {}

    def function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = call("cuModuleGetFunction", self.handle, name.encode())
            self._functions[name] = fn
        return fn


class Context:
    """The primary context of one device, with one stream for everything toygraph does."""

    def __init__(self, ordinal: int = 0):
        init()
        count = int(call("cuDeviceGetCount"))
        if ordinal >= count:
            raise CudaError(f"no CUDA device {ordinal}: {count} device(s) present")
        self.device = call("cuDeviceGet", ordinal)
        self.ctx = call("cuDevicePrimaryCtxRetain", self.device)
        call("cuCtxSetCurrent", self.ctx)
        cu = bindings()
        self.stream = call("cuStreamCreate", int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.arch = device_arch(ordinal)
        self.sm_count = device_sm_count(ordinal)

    def make_current(self):
        call("cuCtxSetCurrent", self.ctx)

    def load_module(self, source: str) -> Module:
        """``source`` compiled by NVRTC for this device (disk-cached) and loaded."""
        from toygraph.cuda.nvrtc import compile_cubin
        return Module(compile_cubin(source, arch=self.arch))

    # --- memory ---------------------------------------------------------------------------
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def alloc(self, nbytes: int) -> int:
        return ptr(call("cuMemAlloc", max(int(nbytes), 1)))

    def free(self, dptr: int) -> None:
        call("cuMemFree", bindings().CUdeviceptr(int(dptr)))

    def alloc_host(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Page-locked host memory and a uint8 numpy view of it (for async uploads)."""
        hp = ptr(call("cuMemAllocHost", max(int(nbytes), 1)))
        view = np.ctypeslib.as_array((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(hp))
        return hp, view

    def free_host(self, hptr: int) -> None:
        call("cuMemFreeHost", int(hptr))

    def htod(self, dptr: int, host: np.ndarray, nbytes: int | None = None) -> None:
        """Async copy of a C-contiguous host array (which must outlive the copy)."""
        n = host.nbytes if nbytes is None else nbytes
        call("cuMemcpyHtoDAsync", bindings().CUdeviceptr(int(dptr)), host.ctypes.data, n,
             self.stream)

    def dtoh(self, host: np.ndarray, dptr: int, nbytes: int | None = None) -> None:
        n = host.nbytes if nbytes is None else nbytes
        call("cuMemcpyDtoHAsync", host.ctypes.data, bindings().CUdeviceptr(int(dptr)), n,
             self.stream)

    def memset(self, dptr: int, value: int, nbytes: int) -> None:
        call("cuMemsetD8Async", bindings().CUdeviceptr(int(dptr)), int(value) & 0xFF,
             int(nbytes), self.stream)

    def sync(self) -> None:
        call("cuStreamSynchronize", self.stream)

    # --- events -----------------------------------------------------------------------------
    def event(self):
        return call("cuEventCreate", int(bindings().CUevent_flags.CU_EVENT_DISABLE_TIMING))

    def record(self, event) -> None:
        call("cuEventRecord", event, self.stream)

    def wait_event(self, event) -> None:
        call("cuEventSynchronize", event)

    def timer(self):
        """An event that keeps its time, for profiling (``event()``'s do not: cheaper)."""
        return call("cuEventCreate", int(bindings().CUevent_flags.CU_EVENT_DEFAULT))

    def elapsed_ms(self, start, end) -> float:
        """Milliseconds between two recorded ``timer()`` events (both must have completed)."""
        return float(call("cuEventElapsedTime", start, end))

    # --- launches and graphs ------------------------------------------------------------
    def launch(self, fn, grid, block, shmem: int, params: np.ndarray) -> None:
        """Launch ``fn``; ``params`` is a uint64 array of addresses of the argument values
        (fixed-width numpy scalars kept alive by the caller)."""
        call("cuLaunchKernel", fn, int(grid[0]), int(grid[1]), int(grid[2]),
             int(block[0]), int(block[1]), int(block[2]), int(shmem), self.stream,
             params.ctypes.data, 0)

    def collective(self, c):
        """The enqueue function of collective ``c`` (launch.Collective) through NCCL; the
        communicator is made now, at realize, never during a capture."""
        from toygraph.cuda.nccl import all_reduce, communicator
        comm = communicator(c.ranks)
        return lambda stream: all_reduce(comm, c.buffers, stream)

    def enqueue(self, fn) -> None:
        """Run ``fn(stream)``, which puts work (an NCCL call) on the stream."""
        fn(ptr(self.stream))

    def capture(self, record_launches) -> "Graph":
        """Capture what ``record_launches()`` puts on the stream into an executable graph."""
        cu = bindings()
        call("cuStreamBeginCapture", self.stream,
             cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            record_launches()
        except BaseException:
            try:
                g = call("cuStreamEndCapture", self.stream)
                call("cuGraphDestroy", g)
            except CudaError:
                pass
            raise
        graph = call("cuStreamEndCapture", self.stream)
        try:
            exe = call("cuGraphInstantiate", graph, 0)
        finally:
            call("cuGraphDestroy", graph)
        return Graph(self, exe)


class Graph:
    """An instantiated CUDA graph, replayed on its context's stream."""

    def __init__(self, ctx: Context, exe):
        self.ctx, self.exe = ctx, exe

    def launch(self) -> None:
        call("cuGraphLaunch", self.exe, self.ctx.stream)

    def destroy(self) -> None:
        if self.exe is not None:
            call("cuGraphExecDestroy", self.exe)
            self.exe = None
