"""The session: realize a graph once on a backend, then upload, run and download per step.

>>> sess = Session(graph, backend="cpu")          # doctest: +SKIP
>>> sess.realize()                                 # doctest: +SKIP
>>> sess.reset()                                   # zero grads and moments
>>> sess.upload(tokens, ids); sess.upload(hp, row)
>>> sess.run("step")                               # forward + backward + update
>>> loss = float(sess.download(loss_t))

``run(phase)`` runs that phase and every phase before it ("forward" < "backward" <
"step"), so one realized graph serves evaluation, gradient accumulation and updates.
"""
from __future__ import annotations

import time

import numpy as np

from toygraph.core import backends
from toygraph.core.frozen_base import plan_base, resolve_mode
from toygraph.core.graph import PHASES, Graph, Tensor, topo_order
from toygraph.core.buffer_plan import BufferPlan, nbytes, plan_buffers
from toygraph.ops.groups import PASS_THROUGH, member
from toygraph.ops.table import INT32_MAX as _INT32_MAX
from toygraph.ops.table import OPS, in_place
from toygraph.errors import GraphError


class Session:
    """Runs one Graph on one backend, found by name (core/backends.py: "cpu", the numpy
    backend, or "cuda", which registers itself). See the module docstring for the step
    sequence.

    Two different settings choose the arithmetic:

    - ``precision``: the input precision of every matmul, the training setting (CLI
      ``--precision``, ``RunConfig.precision``, ``RecipeOptions.precision``,
      ``CudaBackend.precision``): ``"f32"``, or on the cuda backend ``"bf16"`` / ``"tf32"``
      (tensor cores, f32 accumulation; at ``"bf16"`` the activations that only matmuls
      and bf16-aware kernels read are stored in bf16, cuda/bf16_storage.py).
    - ``dtype``: the float type of every buffer on the numpy backend: ``"f32"``, or
      ``"f64"`` for finite-difference gradient checks (cpu only; never a training option).

    ``base_memory`` says how the numpy backend holds frozen consts stored in a block format
    (core/frozen_base.py): ``"decode"`` (f32 copies), ``"quantized"`` (block bytes decoded
    just in time, bit-identical results) or ``"auto"``; None reads
    ``$TOYGRAPH_BASE_MEMORY``. The CUDA backend keeps its own rule (cuda/devmem.py).
    """

    def __init__(self, graph: Graph, backend: str = "cpu", precision: str = "f32",
                 dtype: str = "f32", base_memory: str | None = None):
        self.graph = graph
        self.backend_name = backend
        self.base_memory = resolve_mode(base_memory)
        self.backend = backends.make(backend, precision, dtype)
        self.realized = False
        self.plan: BufferPlan | None = None
        self.realize_seconds = 0.0

    # --- realize ----------------------------------------------------------------------------
    def realize(self) -> BufferPlan:
        """Order, plan memory, compile, allocate and bind consts. Returns the buffer plan."""
        t0 = time.perf_counter()
        g = self.graph
        self.schedules: dict[str, list[Tensor]] = {}
        done: set[int] = set()
        order: list[Tensor] = []
        for phase in PHASES:
            order = order + topo_order(g.outputs[phase] + g.effects[phase], done)
            done = {t.id for t in order}
            self.schedules[phase] = order
        full = self.schedules["step"]
        if not any(t.op for t in full):
            raise GraphError("nothing to run: mark outputs with graph.output() or add effects")
        pinned = {t.id for t in full if t.role is not None}
        pinned |= {t.id for p in PHASES for t in g.outputs[p]}
        self.pinned = pinned
        self.inputs = {t.id: t for t in full if t.role == "input"}
        itemsize = self.backend.itemsize
        pinned_bytes = sum(nbytes(t, 4 if t.dtype == "i32" else itemsize)
                           for t in full if t.id in pinned and not in_place(t.op))
        self.plan = plan_buffers(full, pinned, itemsize, pinned_bytes,
                                 self.backend.storage(full, pinned))
        if self.backend_name == "cpu":
            outputs = [t for p in PHASES for t in g.outputs[p]]
            plan_base(full, self.plan, pinned, outputs, self.base_memory, itemsize)
        self._ranges = self._id_ranges(full)
        self.backend.realize(g, full, self.plan, pinned)
        self._uploaded: set[int] = set()
        self.realized = True
        self.realize_seconds = time.perf_counter() - t0
        return self.plan

    def _id_ranges(self, schedule):
        """For each i32 input, the [low, high) its consumers accept (by their op's
        ``id_ranges``, looking through the pass-through group), and who asks for the tightest
        bound."""
        consumers: dict[int, list[Tensor]] = {}
        for t in schedule:
            for s in t.srcs:
                consumers.setdefault(s.id, []).append(t)
        ranges = {}
        for inp in self.inputs.values():
            if inp.dtype != "i32":
                continue
            bounds = []
            stack = [inp]
            while stack:
                cur = stack.pop()
                for c in consumers.get(cur.id, []):
                    if member(c.op, PASS_THROUGH):   # its readers' range is the input's
                        stack.append(c)
                        continue
                    rule = OPS[c.op].id_ranges
                    wanted = rule(c) if rule else {}
                    bounds += [wanted[i] for i, s in enumerate(c.srcs) if s is cur and i in wanted]
            lo = max((b[0] for b in bounds), default=0)
            hi, why = min(((b[1], b[2]) for b in bounds), default=(_INT32_MAX, "int32"))
            ranges[inp.id] = (lo, hi, why)
        return ranges

    # --- state ------------------------------------------------------------------------------
    def _require_realized(self):
        if not self.realized:
            raise GraphError("session is not realized: call realize() first")

    def reset(self):
        """Zero gradient accumulators and optimizer moments (before the first step)."""
        self._require_realized()
        for t in self.graph.by_role("state"):
            if t.id in self.pinned:
                self.backend.zero(t)

    def reset_grads(self):
        """Zero gradient accumulators only (between optimizer steps)."""
        self._require_realized()
        for t in self.graph.by_role("state"):
            if t.kind in ("grad", "count") and t.id in self.pinned:
                self.backend.zero(t)

    # --- data in and out --------------------------------------------------------------------
    def upload(self, tensor: Tensor | str, value) -> None:
        """Copy ``value`` into an input tensor, after checking shape, dtype and ranges."""
        self._require_realized()
        t = self.graph.find(tensor) if isinstance(tensor, str) else tensor
        if t.role != "input":
            raise GraphError(f"upload: {t.name!r} is a {t.role or 'intermediate'}, not an input")
        if t.id not in self.inputs:
            raise GraphError(f"upload: input {t.name!r} is not used by any phase of this graph")
        a = np.asarray(value)
        if a.shape != t.shape:
            raise GraphError(f"upload {t.name!r}: expected shape {t.shape}, got {a.shape}")
        if t.dtype == "i32":
            if a.dtype.kind not in "iu":
                raise GraphError(f"upload {t.name!r}: expected integer ids, got dtype {a.dtype}")
            lo, hi, why = self._ranges[t.id]
            if a.size and (a.min() < lo or a.max() >= hi):
                bad = a[(a < lo) | (a >= hi)].ravel()[0]
                raise GraphError(f"upload {t.name!r}: value {bad} outside [{lo}, {hi}) "
                                 f"({why})")
        else:
            if a.dtype.kind != "f":
                raise GraphError(f"upload {t.name!r}: expected floating values, got dtype {a.dtype}")
            if not np.all(np.isfinite(a)):
                raise GraphError(f"upload {t.name!r}: contains NaN or inf")
        self.backend.write(t, a)
        self._uploaded.add(t.id)

    def run(self, phase: str = "step") -> None:
        """Run ``phase`` and the phases before it."""
        self._require_realized()
        if phase not in PHASES:
            raise GraphError(f"run: phase must be one of {PHASES}, got {phase!r}")
        nodes = self.schedules[phase]
        self._check_uploaded(nodes, f"run({phase!r})")
        self.backend.run(nodes)

    def _check_uploaded(self, nodes, what: str) -> None:
        missing = [t.name for t in nodes if t.role == "input" and t.id not in self._uploaded]
        if missing:
            raise GraphError(f"{what}: inputs never uploaded: {missing}")

    def program(self, targets) -> list[Tensor]:
        """The realized nodes that compute ``targets`` (outputs or effects), in schedule
        order: a part of the graph to run on its own with :meth:`run_program`. Generation
        keeps its prefill and its one-token decode in one graph this way, sharing the
        weights and the KV cache (kvcache.py). Keeping the schedule's order keeps the
        buffer plan valid for the part."""
        self._require_realized()
        wanted = {t.id for t in topo_order(targets)}
        scheduled = {t.id for t in self.schedules["step"]}
        if not wanted <= scheduled:
            raise GraphError("program: its targets are not part of the realized graph "
                             "(mark them with graph.output() or graph.effect() before realize)")
        return [t for t in self.schedules["step"] if t.id in wanted]

    def run_program(self, nodes: list[Tensor]) -> None:
        """Run the nodes of one :meth:`program` (pass the same list each time: the CUDA
        backend captures a list once and replays it)."""
        self._require_realized()
        self._check_uploaded(nodes, "run_program")
        self.backend.run(nodes)

    def download(self, tensor: Tensor | str) -> np.ndarray:
        """A copy of a pinned tensor's value (outputs, params, state, inputs)."""
        self._require_realized()
        t = self.graph.find(tensor) if isinstance(tensor, str) else tensor
        if t.id not in self.pinned:
            raise GraphError(f"download: {t.name!r} is an intermediate whose buffer is reused; "
                             "mark it with graph.output() before realize")
        return self.backend.read(t)

    def load_param(self, tensor: Tensor, value) -> None:
        """Overwrite a param or state buffer (adapter init from a file, checkpoint resume)."""
        self._require_realized()
        if tensor.role not in ("param", "state"):
            raise GraphError(f"load_param: {tensor.name!r} is not a param or state")
        a = np.asarray(value)
        if a.shape != tensor.shape:
            raise GraphError(f"load_param {tensor.name!r}: expected shape {tensor.shape}, got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise GraphError(f"load_param {tensor.name!r}: contains NaN or inf")
        self.backend.write(tensor, a)
