"""The CUDA backend: NVRTC-compiled kernels, one arena from the shared buffer plan, and
each phase's launch sequence captured once as a CUDA graph and replayed.

Same interface as core/numpy_backend.py's CpuBackend; a Session finds it by the name
``backend="cuda"``, which this module registers (core/backends.py; the package declares it
as an entry point of the ``toygraph.backends`` group, so the core never imports it).
Uploads are async copies into fixed device buffers (inputs go through page-locked staging
buffers); ``read`` is the only host<->device synchronisation.

>>> sess = Session(graph, backend="cuda")          # doctest: +SKIP
>>> sess.realize(); sess.reset(); sess.upload(x, data); sess.run("step")   # doctest: +SKIP

``precision="bf16"`` (or ``"tf32"``) is mixed precision: every matmul runs on tensor cores
(ops/gemm/tc_matmul.cu) with its f32 operands rounded to bf16 (tf32) as they are staged in
shared memory and block-format weights decoded straight to that type, accumulating in f32;
the f32 master weights, the Adam moments, reductions and the residual stream stay f32. At
"bf16" the activations that only bf16-reading kernels consume are also *stored* in bf16
(cuda/bf16_storage.py; ``TOYGRAPH_CUDA_BF16_ACTIVATIONS=0`` keeps every buffer f32).
``"f32"`` (the default) compiles and launches exactly the plain f32 kernels.

>>> sess = Session(graph, backend="cuda", precision="bf16")   # doctest: +SKIP

``TOYGRAPH_CUDA_DEVICE=host`` (or ``CudaBackend(device="host")``) runs everything on the
CPU instead: the same kernels compiled by g++ against ops/include/host_shim.h and executed with their
grids and blocks (host/device.py), slowly but exactly as written; CI uses it to check every
kernel without a GPU. Otherwise the variable (default 0) is the CUDA device ordinal.

Set ``TOYGRAPH_CUDA_GRAPHS=0`` to launch kernels one by one instead of replaying graphs
(useful when debugging a kernel with compute-sanitizer). A phase whose capture fails is
launched that way too, with a warning on the ``toygraph.cuda.backend`` logger.

Frozen consts in a GGUF block format stay in it on the device when every consumer is a
matmul or get_rows that dequantizes tiles on the fly (see devmem.py); the rest get an f32
copy decoded at realize. ``TOYGRAPH_CUDA_QMATMUL=0`` gives every const its f32 copy.
The nodes that need kernel scratch share one buffer, the size of the largest need.
:meth:`CudaBackend.memory_report` says what was allocated and saved.
"""
from __future__ import annotations

import logging

import numpy as np

from toygraph import environment
from toygraph.core import backends
from toygraph.core.buffer_plan import BufferPlan, Storage
from toygraph.ops.table import in_place
from toygraph.precision import PRECISIONS, TENSOR_CORE_PRECISIONS
from toygraph.cuda import driver
from toygraph.cuda.devmem import DeviceMemoryPlan, plan_device_memory, qmatmul_enabled
from toygraph.ops.lowering.device import use_sm_count
from toygraph.ops.lowering.dispatch import lower
from toygraph.ops.lowering.launch import MAX_ELEMENTS, Collective, Launch
from toygraph.ops.lowering.registry import REGISTRY, decode_launch
from toygraph.ops.lowering.sources import backend_source
from toygraph.cuda.bf16_storage import plan_storage
from toygraph.errors import CudaError

logger = logging.getLogger(__name__)
_FLOAT_STORAGE = ("f32", "f64")


def _sm(arch: str) -> int:
    return int("".join(ch for ch in arch[3:] if ch.isdigit()) or 0)


def open_device(device=None):
    """The context kernels run in: ``device`` (else ``$TOYGRAPH_CUDA_DEVICE``, else the
    rank's index on its node under an MPI launcher, else 0) is a CUDA device ordinal, or
    ``"host"`` for the CPU executor."""
    if device is None:
        device = environment.get("TOYGRAPH_CUDA_DEVICE")
        if not environment.given("TOYGRAPH_CUDA_DEVICE"):  # one GPU per rank of a node
            from toygraph.distributed import local_rank
            device = local_rank()
    else:  # an explicit argument is checked like the variable
        device = environment.parse("TOYGRAPH_CUDA_DEVICE", str(device))
    if device == "host":
        from toygraph.cuda.host.device import HostContext
        return HostContext()
    return driver.Context(device)


def _raw_bytes(data) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(data))
    return a.reshape(-1).view(np.uint8)


class CudaBackend:
    name = "cuda"

    def __init__(self, precision: str = "f32", device: int | str | None = None):
        if precision not in PRECISIONS:
            raise CudaError(f"the cuda backend's matmul precision must be one of "
                            f"{', '.join(PRECISIONS)} ('bf16' / 'tf32': tensor-core matmuls), "
                            f"got {precision!r} (its buffers are f32; use backend='cpu' "
                            "with dtype='f64' for gradient checks)")
        self.precision = precision
        self.itemsize = 4   # f32 buffers (at "bf16" the plan makes some activations 2 bytes)
        self.ctx = open_device(device)
        if precision in TENSOR_CORE_PRECISIONS and _sm(self.ctx.arch) < 80:
            raise CudaError(f"precision {precision!r} needs tensor cores with bf16/tf32 mma "
                            f"(sm_80 or newer); this device is {self.ctx.arch}: use precision='f32'")
        self.use_graphs = environment.get("TOYGRAPH_CUDA_GRAPHS")
        self.qmatmul = qmatmul_enabled()
        self.memory: DeviceMemoryPlan | None = None
        self.raw_consts: frozenset[int] = frozenset()  # consts kept in block format
        self.ptrs: dict[int, int] = {}          # tensor id -> device address
        self._owned: list[int] = []             # device allocations to free
        self.scratch_ptr = 0                    # the scratch every node shares (devmem.py)
        self._staging: dict[int, tuple] = {}    # input id -> (host ptr, view, event)
        self._keep: list[np.ndarray] = []       # host arrays an async copy still reads
        self._launches: dict[int, list] = {}    # node id -> prepared launches
        self._graphs: dict[tuple, object] = {}  # phase key -> driver.Graph or None (eager)
        self._phase_refs: list = []
        self.module = None

    # --- realize ------------------------------------------------------------------------------
    def storage(self, schedule, pinned) -> Storage:
        """The activations kept in bf16 and the products computed inside another node's
        GEMM, at precision "bf16" (cuda/bf16_storage.py; nothing at another precision)."""
        return plan_storage(schedule, pinned, self.precision)

    def realize(self, graph, schedule, plan: BufferPlan, pinned: set[int]):
        """Compile, allocate the arena and pinned buffers, upload consts and params."""
        self.ctx.make_current()
        use_sm_count(self.ctx.sm_count)   # what split-K fills (ops/lowering/device.py)
        missing = sorted({t.op for t in schedule if t.op is not None and t.op not in REGISTRY})
        if missing:
            raise CudaError(f"the cuda backend has no kernel for ops {missing}")
        for t in schedule:
            if t.size > MAX_ELEMENTS:
                raise CudaError(f"tensor {t.name!r} has {t.size} elements; the CUDA kernels "
                                f"index with int32 (at most {MAX_ELEMENTS})")
        outputs = [t for ts in getattr(graph, "outputs", {}).values() for t in ts]
        mem = plan_device_memory(schedule, plan, pinned, outputs, qmatmul=self.qmatmul,
                                 precision=self.precision)
        self.memory = mem
        self.raw_consts = frozenset(mem.raw_consts)
        own = [t for t in schedule if t.id in mem.f32_buffers or t.id in mem.raw_consts]
        for t in schedule:
            if t.id in plan.offsets:
                end = plan.offsets[t.id] + t.size * (2 if t.id in plan.bf16 else self.itemsize)
                if plan.offsets[t.id] < 0 or end > plan.arena_bytes:
                    raise CudaError(f"buffer plan places {t.name!r} at bytes "
                                    f"[{plan.offsets[t.id]}, {end}) outside the arena of "
                                    f"{plan.arena_bytes} bytes")
            elif (t.op is not None and not in_place(t.op) and t.id not in pinned
                  and t.id not in plan.absorbed):
                raise CudaError(f"buffer plan has no place for {t.name!r}")
        needed = mem.peak_bytes
        free, total = self.ctx.mem_info()
        if needed > free:
            raise CudaError(f"realize needs {needed} bytes of device memory ({plan.summary()}) "
                            f"but only {free} of {total} bytes are free")
        try:
            arena = self._alloc(plan.arena_bytes) if plan.arena_bytes else 0
            for tid, off in plan.offsets.items():
                self.ptrs[tid] = arena + off
            for t in own:
                nbytes = mem.f32_buffers.get(t.id) or mem.raw_consts[t.id]
                self.ptrs[t.id] = self._alloc(max(1, nbytes))
            # One scratch buffer for every node that needs some (devmem.py says why that
            # is safe); a node that declares none gets a null pointer, not this buffer.
            self.scratch_ptr = self._alloc(mem.scratch_bytes) if mem.scratch_bytes else 0
        except CudaError as e:
            if "OUT_OF_MEMORY" not in str(e):
                raise
            free, _ = self.ctx.mem_info()
            raise CudaError(f"out of device memory at realize: planned {needed} bytes "
                            f"({plan.summary()}), {free} bytes free ({e})") from None
        self.module = self.ctx.load_module(backend_source(self.precision))
        for t in own:
            self._bind(t)
        for t in schedule:
            if t.op is not None:
                scratch = self.scratch_ptr if t.id in mem.scratch else 0
                launches = lower(t, self._ptr, scratch, self.raw_consts, self.precision,
                                 plan.bf16, plan.absorbed)
                self._launches[t.id] = [self._prepare(l) for l in launches]
        self.ctx.sync()
        self._keep.clear()
        self.schedule = schedule

    def _alloc(self, nbytes: int) -> int:
        d = self.ctx.alloc(nbytes)
        self._owned.append(d)
        return d

    def _ptr(self, t) -> int:
        try:
            return self.ptrs[t.id]
        except KeyError:
            raise CudaError(f"tensor {t.name!r} has no device buffer") from None

    def memory_report(self) -> dict:
        """Device bytes realize allocated, by kind, and what keeping block-format consts
        saved against f32 copies (``saved_bytes``; 0 with ``TOYGRAPH_CUDA_QMATMUL=0``).

        >>> sess.backend.memory_report()["saved_bytes"]      # doctest: +SKIP
        441483264
        """
        if self.memory is None:
            raise CudaError("memory_report: the backend is not realized")
        return dict(self.memory.report(), qmatmul=self.qmatmul)

    def _prepare(self, launch: Launch):
        if isinstance(launch, Collective):  # not a kernel: the context enqueues it
            return self.ctx.collective(launch)
        fn = self.module.function(launch.kernel)
        params = np.array([a.ctypes.data for a in launch.args], np.uint64)
        return fn, launch.grid, launch.block, launch.shmem, params, launch  # keeps args alive

    def _bind(self, t):
        """Fill a pinned buffer: consts and params get their values, the rest zeros."""
        dptr = self.ptrs[t.id]
        if t.role == "const":
            if t.id in self.raw_consts:
                self._upload(dptr, self._block_bytes(t))
            elif t.storage in _FLOAT_STORAGE:
                from toygraph.core.numpy_backend import const_array
                self._upload(dptr, const_array(t, np.float32))
            else:
                self._dequantize(t, dptr)
        elif t.role == "param":
            self._upload(dptr, np.asarray(t.data, np.float32).reshape(t.shape))
        else:
            self.ctx.memset(dptr, 0, 4 * max(t.size, 1))
        if t.role == "input":
            hptr, view = self.ctx.alloc_host(4 * max(t.size, 1))
            self._staging[t.id] = (hptr, view, self.ctx.event(), False)

    def _dequantize(self, t, dptr: int):
        """Upload a const in its stored block format and decode it on the GPU into f32."""
        decode_launch(t.name, t.storage, dptr, 0, t.size)  # an unknown format fails first
        raw = self._block_bytes(t)
        tmp = self.ctx.alloc(raw.size)
        try:
            self.ctx.htod(tmp, raw)
            launch = decode_launch(t.name, t.storage, dptr, tmp, t.size)
            fn, grid, block, shmem, params, _keep = self._prepare(launch)
            self.ctx.launch(fn, grid, block, shmem, params)
            self.ctx.sync()  # the raw bytes may go: one quantized tensor on the GPU at a time
        finally:
            self.ctx.free(tmp)

    @staticmethod
    def _block_bytes(t) -> np.ndarray:
        from toygraph.gguf import blocks
        raw = _raw_bytes(t.data)
        want = blocks.nbytes(t.storage, t.shape)
        if raw.size != want:
            raise CudaError(f"const {t.name!r}: {t.storage} data of shape {t.shape} needs "
                            f"{want} bytes, got {raw.size}")
        return raw

    def _upload(self, dptr: int, value: np.ndarray):
        arr = np.ascontiguousarray(value)
        self._keep.append(arr)
        self.ctx.htod(dptr, arr)

    # --- run ----------------------------------------------------------------------------------
    def run(self, nodes):
        """Launch every node of ``nodes`` on the stream; no host synchronisation."""
        self.ctx.make_current()
        key = (id(nodes), len(nodes))
        if not self.use_graphs:
            self._launch_all(nodes)
            return
        if key not in self._graphs:
            self._phase_refs.append(nodes)  # keep the list alive so its id is never reused
            try:
                self._graphs[key] = self.ctx.capture(lambda: self._launch_all(nodes))
            except CudaError as e:  # this driver cannot capture it: launch eagerly
                logger.warning("CUDA graph capture of a %d-node phase failed, launching its "
                               "kernels one by one instead (slower): %s", len(nodes), e)
                self._graphs[key] = None
        g = self._graphs[key]
        if g is None:
            self._launch_all(nodes)
        else:
            g.launch()

    def _launch_all(self, nodes):
        launch = self.ctx.launch
        for t in nodes:
            for item in self._launches.get(t.id, ()):
                if callable(item):  # a collective (all_reduce), enqueued on the same stream
                    self.ctx.enqueue(item)
                    continue
                fn, grid, block, shmem, params, _launch = item
                launch(fn, grid, block, shmem, params)

    # --- data in and out --------------------------------------------------------------------
    def write(self, t, value: np.ndarray):
        """Async upload into ``t``'s buffer (inputs via their page-locked staging copy)."""
        self.ctx.make_current()
        dt = np.int32 if t.dtype == "i32" else np.float32
        staged = self._staging.get(t.id)
        if staged is None:
            arr = np.empty(t.shape, dt)
            np.copyto(arr, value, casting="unsafe")
            self._upload(self.ptrs[t.id], arr)
            return
        hptr, view, event, recorded = staged
        if recorded:
            self.ctx.wait_event(event)  # the previous copy out of this staging buffer is done
        host = view[:4 * max(t.size, 1)].view(dt)[:t.size].reshape(t.shape)
        np.copyto(host, value, casting="unsafe")
        self.ctx.htod(self.ptrs[t.id], host)
        self.ctx.record(event)
        self._staging[t.id] = (hptr, view, event, True)

    def read(self, t) -> np.ndarray:
        """A copy of ``t``'s buffer; waits for everything queued before it."""
        self.ctx.make_current()
        if t.id in self.raw_consts:  # frozen, so its host data is its value
            from toygraph.core.numpy_backend import const_array
            return np.array(const_array(t, np.float32))
        out = np.empty(t.shape, np.int32 if t.dtype == "i32" else np.float32)
        self.ctx.dtoh(out, self._ptr(t), out.nbytes)
        self.ctx.sync()
        self._keep.clear()
        return out

    def zero(self, t):
        self.ctx.memset(self._ptr(t), 0, 4 * max(t.size, 1))

    # --- teardown -----------------------------------------------------------------------------
    def close(self):
        """Free device and page-locked memory now (otherwise at garbage collection)."""
        try:
            self.ctx.sync()
        except CudaError:
            pass
        for g in self._graphs.values():
            if g is not None:
                g.destroy()
        self._graphs.clear()
        for hptr, *_ in self._staging.values():
            self.ctx.free_host(hptr)
        self._staging.clear()
        for d in self._owned:
            self.ctx.free(d)
        self._owned.clear()
        self.ptrs.clear()
        self.scratch_ptr = 0

    def __del__(self):
        try:
            if getattr(self, "ctx", None) is not None:
                self.close()
        except Exception:
            pass


def _make(precision: str, dtype: str) -> CudaBackend:
    """The CUDA backend a Session asks for by name (core/backends.py)."""
    if dtype != "f32":
        raise CudaError(f"the cuda backend computes in f32, got dtype {dtype!r} "
                        "(use backend='cpu' with dtype='f64' for gradient checks)")
    return CudaBackend(precision)


backends.register("cuda", _make)
