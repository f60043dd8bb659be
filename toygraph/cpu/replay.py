"""The CPU engine's replay of a plan: a run of graph nodes as one engine call.

An op family that has engine kernels says, in its ``cpu.py``, how a node of one of its ops
becomes a call of its kernel: ``@replays("rms_norm")`` registers a function
``(node, out, srcs, attrs) -> Call | None`` that is given the arrays the numpy backend
holds for the node (``out``, the sources; a frozen const kept in its blocks is a
``cpu.block_tensor.BlockTensor``) and returns the kernel's name and operands, or None for
a node it does not take (a layout, dtype or option its kernel lacks: that node keeps its
numpy kernel); ``@fuses(op, op, ...)`` one for a chain of nodes computed as one (generation's
attention over its cache). The kernels themselves are C++ in the same folder (``cpu.h``, built into the
engine: replay.h says how).

:class:`Program` turns the calls of a run of nodes into the engine's node array once (at
realize: the arrays never move) and :meth:`Program.run` replays it with one ctypes call.

>>> prog = Program([Call("add", [out, a, b], [out.size])], ["add"])   # doctest: +SKIP
>>> prog.run()                                                        # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from toygraph.cpu import engine
from toygraph.errors import ToygraphError

#: replay.h's ReplayNode, field for field.
NODE = np.dtype([("kernel", np.int32), ("spare", np.int32), ("p", np.uint64, 12),
                 ("i", np.int64, 16), ("f", np.float64, 8)])
MAX_POINTERS, MAX_INTS, MAX_FLOATS = 12, 16, 8


@dataclass
class Call:
    """One node as an engine kernel call: the kernel's name (its ``TG_REPLAY_KERNEL`` in a
    family's cpu.h), its addresses (arrays, a BlockTensor's bytes, or None), integers and
    reals; ``keep`` holds what the addresses point into that nothing else keeps alive (a
    list of addresses built for the call)."""
    kernel: str
    pointers: list
    ints: list = field(default_factory=list)
    floats: list = field(default_factory=list)
    keep: list = field(default_factory=list)


#: The calls of the ops that have engine kernels: op -> (node, out, srcs, attrs) -> Call | None.
REPLAYS: dict[str, Callable] = {}


def replays(op: str):
    """Register the decorated function as the way a node of ``op`` becomes an engine call."""
    def register(fn):
        if op in REPLAYS:
            raise ToygraphError(f"op {op!r} has two engine replays")
        REPLAYS[op] = fn
        return fn
    return register


#: Chains of nodes engine kernels compute together: a tuple of ops (each node the next
#: one's first source, and read by nothing else) -> (nodes, outs, srcs per node) -> a list
#: of (index of the chain node a call runs at, Call), or None. A call runs where its node
#: would (its sources ready there; a value it hands to a later call of the chain lives in
#: memory of their own, never in the buffer plan's slots); the chain's other results are
#: never written.
FUSIONS: dict[tuple[str, ...], Callable] = {}


def _enters(table: dict, key):
    """A decorator entering its function in ``table`` under ``key``."""
    def register(fn):
        table[key] = fn
        return fn
    return register


def fuses(*ops: str):
    """Register the decorated function as the engine calls of a chain of ``ops``."""
    return _enters(FUSIONS, tuple(ops))


#: Nodes of one op that read one first source and that an engine kernel computes together
#: (generation's q, k and v products of one x): op -> (nodes, outs, srcs per node) -> Call
#: or None. The call runs at the first node's place; the backend makes sure that no node in
#: between reads or writes what the later ones write (numpy_backend's ``_siblings``).
SIBLINGS: dict[str, Callable] = {}
#: op -> (node, its source arrays) -> whether the node may join its siblings' call (absent:
#: every node of the op may): generation's q, k and v products with a LoRA adapter read x
#: beside the adapter's x A^T, which is not a product on blocks.
SIBLING_JOINS: dict[str, Callable] = {}


def siblings(op: str, joins: Callable | None = None):
    """Register the decorated function as the engine call of sibling nodes of ``op``, and
    ``joins`` as which nodes of it may be siblings."""
    if joins is not None:
        SIBLING_JOINS[op] = joins
    return _enters(SIBLINGS, op)


#: A node's forward and its backward where the forward's kernel can hand the backward a
#: value the backward would recompute from the same sources (the fused head's first chunk
#: of softmax(z) - onehot): (op, op) -> (first call, second call, cell) -> None, adding
#: ``cell`` (a few words of memory both kernels address) to both calls. The backend pairs
#: them (numpy_backend's ``_handoffs``) only where both run in the engine and nothing in
#: between writes the sources they share.
HANDOFFS: dict[tuple[str, str], Callable] = {}

#: The cell's size in bytes: room for what a kernel hands over (an address and sizes).
HANDOFF_BYTES = 64


def hands_off(first: str, second: str):
    """Register the decorated function as the way a node of ``first`` hands a node of
    ``second`` (its backward) what it computed."""
    return _enters(HANDOFFS, (first, second))


def address(a) -> int:
    """The address an operand is read or written at: an array's data (0 for None)."""
    if a is None:
        return 0
    if isinstance(a, int):
        return a
    return a.ctypes.data


def addresses(arrays) -> np.ndarray:
    """The addresses of ``arrays`` as a uint64 array (a kernel taking a list of tensors is
    given this array's address; the Call keeps it)."""
    return np.array([address(a) for a in arrays], np.uint64)


def f32_contiguous(*arrays) -> bool:
    """Whether every array is f32 and C-contiguous (what the kernels read and write)."""
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
               for a in arrays)


class Program:
    """A run of nodes as the engine's node array, replayed in one call. ``ops`` names each
    call's op, for the error that says which node failed."""

    def __init__(self, calls: list[Call], ops: list[str], lib=None):
        self.lib = lib or engine.library()
        if self.lib is None:
            raise ToygraphError("the CPU engine is not built: no replay")
        self.ops = ops
        self.kernels = [c.kernel for c in calls]
        self.nodes = np.zeros(len(calls), NODE)
        self.keep = []
        for k, c in enumerate(calls):
            if len(c.pointers) > MAX_POINTERS or len(c.ints) > MAX_INTS or len(c.floats) > MAX_FLOATS:
                raise ToygraphError(f"replay call {c.kernel}: too many operands")
            node = self.nodes[k]
            node["kernel"] = kernel_index(self.lib, c.kernel)
            node["p"][:len(c.pointers)] = [address(a) for a in c.pointers]
            node["i"][:len(c.ints)] = [int(v) for v in c.ints]
            node["f"][:len(c.floats)] = [float(v) for v in c.floats]
            self.keep.append((c.pointers, c.keep))
        self._failed = np.zeros(1, np.int64)
        self._args = (self.nodes.ctypes.data, len(calls), self._failed.ctypes.data)
        #: Each node's time in seconds at the last :meth:`run` with ``timed`` (op profiles).
        self.seconds = np.zeros(len(calls))

    def run(self, timed: bool = False) -> None:
        """Replay every node; ``timed`` also records each node's wall time (``seconds``)."""
        ns = np.zeros(len(self.nodes), np.int64) if timed else None
        rc = self.lib.tg_replay(*self._args, None if ns is None else ns.ctypes.data)
        if ns is not None:
            self.seconds = ns * 1e-9
        if rc != 0:
            k = int(self._failed[0])
            raise ToygraphError(f"CPU engine replay: node {k} ({self.ops[k]}) failed "
                                f"(code {rc})")


_INDEX: dict[tuple[int, str], int] = {}


def kernel_index(lib, name: str) -> int:
    """The engine's index of the kernel called ``name`` (looked up once per library)."""
    key = (id(lib), name)
    if key not in _INDEX:
        k = lib.tg_replay_kernel(name.encode())
        if k < 0:
            raise ToygraphError(f"the CPU engine has no replay kernel {name!r}")
        _INDEX[key] = k
    return _INDEX[key]

