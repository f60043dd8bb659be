"""The graph DSL: a Graph owns Tensor nodes; building checks shapes, running is a Session's job.

>>> g = Graph()
>>> x = g.input("x", (4, 8))
>>> w = g.param("w", init=np.zeros((8, 3), np.float32))
>>> y = (x @ w).silu().sum()
>>> y.shape
()

Roles: ``input`` (uploaded every step), ``const`` (frozen weight, possibly stored quantized),
``param`` (trainable, with an initial value), ``state`` (optimizer moments and gradient
accumulators), and ``None`` for intermediates. Logical dtypes are ``f32`` and ``i32``; a
const's ``storage`` names the block format its data is kept in (``f32``, ``f16``, ``q4_1``...).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from toygraph import ops
from toygraph.errors import GraphError

FLOAT, INT = "f32", "i32"
PHASES = ("forward", "backward", "step")


class Tensor:
    """One node of a Graph. Use Graph methods or operators to make them."""

    __slots__ = ("graph", "id", "op", "srcs", "attrs", "shape", "dtype", "name", "role",
                 "data", "storage", "kind", "after")

    def __init__(self, graph, id, op, srcs, attrs, shape, dtype, name, role):
        self.graph, self.id, self.op, self.srcs, self.attrs = graph, id, op, srcs, attrs
        self.shape, self.dtype, self.name, self.role = shape, dtype, name, role
        self.data = None      # initial value (param) or backing array (const)
        self.storage = dtype  # block format of a const's data
        self.kind = None      # for state: "grad", "count", "moment" or "cache"
        # Ordering-only predecessors: scheduled before this node, never read by it (set by
        # graph transformations such as recompute.checkpoint_regions).
        self.after: tuple[Tensor, ...] = ()

    def __repr__(self):
        what = self.role or self.op
        return f"Tensor({self.name!r}, {what}, shape={self.shape}, {self.dtype})"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # Operator sugar. Python scalars on either side of * become a scale.
    def __matmul__(self, other):
        return ops.matmul(self, other)

    def __add__(self, other):
        return ops.add(self, other)

    def __sub__(self, other):
        return ops.sub(self, other)

    def __mul__(self, other):
        if isinstance(other, (int, float)):
            return ops.scale(self, float(other))
        return ops.mul(self, other)

    __rmul__ = __mul__

    def __neg__(self):
        return ops.scale(self, -1.0)

    # Methods for everything else; each is a thin call into an op builder (ops/).
    def matmul(self, other, trans_a=False, trans_b=False):
        return ops.matmul(self, other, trans_a=trans_a, trans_b=trans_b)

    def rms_norm(self, eps: float, weight=None):
        return ops.rms_norm(self, eps, weight=weight)

    def rope(self, positions, dims: int, base: float, mode: str = "normal"):
        return ops.rope(self, positions, dims=dims, base=base, mode=mode)

    def softmax(self, scale: float = 1.0, causal: bool = False):
        return ops.softmax(self, scale=scale, causal=causal)

    def silu(self):
        return ops.silu(self)

    def gelu(self):
        return ops.gelu(self)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return ops.reshape(self, tuple(shape))

    def permute(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return ops.permute(self, tuple(axes))

    def transpose(self, a: int = -2, b: int = -1):
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return ops.permute(self, tuple(axes))

    @property
    def T(self):
        return self.transpose()

    def contiguous(self):
        return ops.contiguous(self)

    def sum(self, axis=None):
        return ops.sum(self, axis)

    def mean(self, axis=None):
        return ops.mean(self, axis)


@dataclass
class Region:
    """A named stretch of the forward graph (one decoder block) that reads ``input``
    and yields ``output``: node ids ``start <= id < end``. Transformations use regions as
    units, e.g. activation checkpointing recomputes one from its input during backward."""

    name: str
    input: Tensor
    start: int
    end: int = -1
    output: Tensor | None = None


class Graph:
    """Owns the nodes of one computation, its outputs and its side effects per phase.

    Side effects (gradient accumulation, the optimizer update) are nodes that write into
    param or state buffers; each belongs to a phase. A session runs a phase and every
    phase before it: "forward" < "backward" < "step".
    """

    def __init__(self):
        self.nodes: list[Tensor] = []
        self.outputs: dict[str, list[Tensor]] = {p: [] for p in PHASES}
        self.effects: dict[str, list[Tensor]] = {p: [] for p in PHASES}
        self._names: set[str] = set()
        self.regions: list[Region] = []
        self._open_region: str | None = None

    # --- leaves -------------------------------------------------------------------------
    def _leaf(self, role, name, shape, dtype):
        if name in self._names:
            raise GraphError(f"{role} {name!r}: a tensor of that name already exists")
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise GraphError(f"{role} {name!r}: every dimension must be positive, got {shape}")
        if dtype not in (FLOAT, INT):
            raise GraphError(f"{role} {name!r}: dtype must be 'f32' or 'i32', got {dtype!r}")
        self._names.add(name)
        t = Tensor(self, len(self.nodes), None, (), {}, shape, dtype, name, role)
        self.nodes.append(t)
        return t

    def input(self, name: str, shape: Sequence[int], dtype: str = FLOAT) -> Tensor:
        """A tensor uploaded before each run (token ids, positions, labels, hp row)."""
        return self._leaf("input", name, shape, dtype)

    def const(self, name: str, data=None, *, shape=None, storage: str = FLOAT) -> Tensor:
        """A frozen weight. ``data`` is an array (f32/f64) or raw block bytes with
        ``storage`` naming the format (see gguf/blocks.py) and ``shape`` the logical shape."""
        if shape is None:
            if data is None:
                raise GraphError(f"const {name!r}: give data or a shape")
            shape = np.shape(data)
        t = self._leaf("const", name, shape, FLOAT)
        t.data, t.storage = data, storage
        return t

    def param(self, name: str, init: np.ndarray) -> Tensor:
        """A trainable tensor with its initial value (f32)."""
        init = np.asarray(init)
        if init.dtype.kind != "f":
            raise GraphError(f"param {name!r}: initial value must be floating, got {init.dtype}")
        if not np.all(np.isfinite(init)):
            raise GraphError(f"param {name!r}: initial value has NaN or inf")
        t = self._leaf("param", name, init.shape, FLOAT)
        t.data = init
        return t

    def state(self, name: str, shape: Sequence[int], kind: str) -> Tensor:
        """A zero-initialised buffer that lives across runs (grads, counts, moments, and
        generation's KV cache)."""
        if kind not in ("grad", "count", "moment", "cache"):
            raise GraphError(f"state {name!r}: kind must be grad, count, moment or cache, "
                             f"got {kind!r}")
        t = self._leaf("state", name, shape, FLOAT)
        t.kind = kind
        return t

    def scalar(self, value: float, name: str | None = None) -> Tensor:
        """A constant f32 scalar (e.g. the seed 1.0 of backward)."""
        name = name or f"scalar{len(self.nodes)}"
        return self.const(name, np.array(value, np.float32))

    # --- nodes --------------------------------------------------------------------------
    def node(self, op: str, srcs: Sequence[Tensor], attrs: dict | None = None,
             name: str | None = None) -> Tensor:
        """Create an op node, checking shapes and dtypes by the op's rule (ops.OPS)."""
        spec = ops.OPS.get(op)
        if spec is None:
            raise GraphError(f"unknown op {op!r}")
        attrs = dict(attrs or {})
        for s in srcs:
            if not isinstance(s, Tensor):
                raise GraphError(f"{op}: operands must be Tensors, got {type(s).__name__}")
            if s.graph is not self:
                raise GraphError(f"{op}: operand {s.name!r} belongs to another graph")
        try:
            shape, dtype = spec.infer([s.shape for s in srcs], [s.dtype for s in srcs], attrs)
        except GraphError as e:
            operands = ", ".join(f"{s.name} {s.shape} {s.dtype}" for s in srcs)
            raise GraphError(f"{op}({operands}): {e}") from None
        t = Tensor(self, len(self.nodes), op, tuple(srcs), attrs, tuple(shape), dtype,
                   name or f"{op}{len(self.nodes)}", None)
        self.nodes.append(t)
        return t

    def output(self, t: Tensor, phase: str = "forward") -> Tensor:
        """Mark ``t`` to be kept and downloadable after running ``phase``."""
        self._check_phase(phase)
        if t not in self.outputs[phase]:
            self.outputs[phase].append(t)
        return t

    def effect(self, t: Tensor, phase: str) -> Tensor:
        """Register a side-effect node (one that writes a param/state buffer) in ``phase``."""
        self._check_phase(phase)
        self.effects[phase].append(t)
        return t

    @contextmanager
    def region(self, name: str, input: Tensor):
        """Record the nodes built inside the ``with`` as one Region reading ``input``;
        set ``region.output`` before leaving it.

        >>> with g.region("blk.0", h) as r:                 # doctest: +SKIP
        ...     r.output = block(h)
        """
        if input.graph is not self:
            raise GraphError(f"region {name!r}: input {input.name!r} belongs to another graph")
        if self._open_region is not None:
            raise GraphError(f"region {name!r}: regions do not nest (inside {self._open_region!r})")
        r = Region(name, input, start=len(self.nodes))
        self._open_region = name
        try:
            yield r
        finally:
            self._open_region = None
        r.end = len(self.nodes)
        if r.output is None or not r.start <= r.output.id < r.end:
            raise GraphError(f"region {name!r}: its output must be a node built inside it")
        self.regions.append(r)

    @staticmethod
    def _check_phase(phase):
        if phase not in PHASES:
            raise GraphError(f"phase must be one of {PHASES}, got {phase!r}")

    def by_role(self, role: str) -> list[Tensor]:
        return [t for t in self.nodes if t.role == role]

    def find(self, name: str) -> Tensor:
        for t in self.nodes:
            if t.name == name:
                return t
        raise GraphError(f"no tensor named {name!r} in the graph")


def topo_order(targets: Iterable[Tensor], done: set[int] | None = None) -> list[Tensor]:
    """Nodes needed for ``targets`` in dependency order, skipping ids in ``done``.

    Iterative so that deep graphs (30-layer models, their backward) never hit the
    recursion limit. A node's ordering-only predecessors (``after``) are placed before it
    like its sources, and visited first.
    """
    done = set() if done is None else done
    order, seen = [], set(done)
    for target in targets:
        stack = [(target, False)]
        while stack:
            t, expanded = stack.pop()
            if t.id in seen and not expanded:
                continue
            if expanded:
                order.append(t)
                continue
            seen.add(t.id)
            stack.append((t, True))
            for s in reversed(t.after + t.srcs):
                if s.id not in seen:
                    stack.append((s, False))
    return order
