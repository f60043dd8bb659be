"""The numpy backend: buffers from the shared plan, one kernel call per scheduled node. The
kernels are the ops' own (``ops.KERNELS``, each in its family module of toygraph/ops/).

A frozen base the plan keeps quantized (``plan.quantized``, core/frozen_base.py) is held as
``cpu.block_tensor.BlockTensor``s. A node whose op has a block kernel serving it reads the
blocks itself (``ops.BLOCK_KERNELS``: matmul through the CPU engine, get_rows, expert_matmul);
any other node reading one gets it decoded into the decode scratch first and its kernel
reads that. The scratch remembers what it holds, so a node reading the const the previous
decode left there decodes nothing. ``decode_seconds`` adds up the time spent decoding into
the scratch.
"""
from __future__ import annotations

import time

import numpy as np

from toygraph import environment
from toygraph.core.buffer_plan import BufferPlan, Storage
from toygraph.core.frozen_base import check_fits, scratch_layout
from toygraph.ops import BLOCK_KERNELS, KERNELS, groups
from toygraph.cpu import engine, replay, threads
from toygraph.errors import GraphError
from toygraph.cpu.block_tensor import BlockTensor

DTYPES = {"f32": np.float32, "f64": np.float64}


def const_array(t, dtype) -> np.ndarray:
    """A const's value as a float array: f32 mmap'd data is used in place, anything stored
    in another format (f16, bf16, quantized blocks) is decoded once (the base's "decode"
    mode)."""
    data = np.asarray(t.data)
    if t.storage != "f32":
        return BlockTensor(data, t.storage, t.shape).decode_into(np.empty(t.shape, dtype))
    # raw GGUF bytes or an array: either way no copy is made here
    arr = (data.view(np.float32) if data.dtype == np.uint8 else data).reshape(t.shape)
    return arr if arr.dtype == dtype else arr.astype(dtype)


class CpuBackend:
    name = "cpu"

    def __init__(self, dtype: str = "f32"):
        if dtype not in DTYPES:
            raise GraphError(f"cpu backend dtype must be f32 or f64, got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.itemsize = np.dtype(self.dtype).itemsize
        self.arrays: dict[int, np.ndarray] = {}

    def storage(self, schedule, pinned) -> Storage:
        """Every buffer in the backend's dtype, every node computed on its own (the
        reference arithmetic)."""
        return Storage()

    def realize(self, graph, schedule, plan: BufferPlan, pinned: set[int]):
        missing = [n.op for n in schedule if n.op is not None and n.op not in KERNELS]
        if missing:
            raise GraphError(f"cpu backend has no kernel for ops {sorted(set(missing))}")
        check_fits(plan)  # before allocating anything
        self.arena = np.zeros(max(plan.arena_bytes, 1), np.uint8)
        for t in schedule:
            if t.id in plan.quantized:
                self.arrays[t.id] = BlockTensor(t.data, t.storage, t.shape)
            elif t.role == "const":
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
        # cache_write hands on the cache it wrote: its output is the state's own buffer, not
        # a copy (the copy was the whole cache a layer a generated token: 1 MB a layer at
        # SmolLM2's 1,300 rows). The plan's arena slot for it goes unused.
        for t in schedule:
            if t.op == "cache_write" and t.srcs[0].role == "state":
                self.arrays[t.id] = self.arrays[t.srcs[0].id]
        self.schedule = schedule
        self._pinned = pinned                # read by the host: never fused away
        self._readers: dict[int, int] = {}   # how many nodes read each tensor (fusions)
        for t in schedule:
            for src in t.srcs:
                self._readers[src.id] = self._readers.get(src.id, 0) + 1
        self._programs: dict[int, tuple] = {}   # run's compiled phases, by id of the list
        self._plan_decodes(schedule, plan)
        # The engine multiplies the base on its blocks: BLAS (what is left: adapters,
        # attention) on one thread, so the two pools never spin on the same cores.
        self.engine_carries = bool(plan.quantized) and self.itemsize == 4 and engine.available()
        self.replays = (environment.get("TOYGRAPH_CPU_REPLAY") == "engine"
                        and self.itemsize == 4 and engine.available())
        if self.replays:
            import toygraph.ops.replays  # noqa: F401  (the families' replay entries)

    def _plan_decodes(self, schedule, plan: BufferPlan):
        """Per node reading a quantized const: its scratch layout and the views of it (one
        to decode into, one read-only for the kernel); an empty layout means the op's block
        kernel reads the bytes itself."""
        scratch = np.zeros(plan.scratch_bytes // self.itemsize, self.dtype)
        self.decodes: dict[int, tuple[dict, dict]] = {}
        for t in schedule:
            if t.op is None or not any(s.id in plan.quantized for s in t.srcs):
                continue
            layout, need = scratch_layout(t, plan.quantized, self.itemsize)
            if not layout:  # the op's block kernel reads the bytes (and maybe the scratch)
                self.decodes[t.id] = (layout, scratch[:need // self.itemsize] if need else None)
                continue
            views = {}
            for s in t.srcs:
                if s.id in layout:
                    start = layout[s.id] // self.itemsize
                    fill = scratch[start:start + s.size].reshape(s.shape)
                    read = fill.view()
                    read.flags.writeable = False
                    views[s.id] = (fill, read)
            self.decodes[t.id] = (layout, views)
        self._held: dict | None = None  # the layout whose values the scratch holds
        self.decode_seconds = 0.0

    def run(self, nodes):
        threads.blas_beside_engine(self.engine_carries or self.replays)
        steps = self._programs.get(id(nodes))
        if steps is None or steps[0] is not nodes:
            if len(self._programs) >= 32:   # callers pass their phases' own lists; bounded
                self._programs.pop(next(iter(self._programs)))
            steps = self._programs[id(nodes)] = (nodes, self._compile(nodes))
        for op, out, srcs, attrs, t in steps[1]:
            if op is None:
                out.run()                       # a run of nodes replayed in the engine
            elif t is None:
                KERNELS[op](out, srcs, attrs)   # looked up here: profilers patch KERNELS
            else:
                self._run_with_blocks(t, srcs)

    def _compile(self, nodes) -> list:
        """A phase as (op, out, sources, attrs, node) per kernel call, its arrays looked up
        once (they never change after realize; writes go into them): generation runs a
        phase of ~850 small nodes a token. ``node`` is set for one that reads blocks.
        Replaying, a run of nodes the engine takes is one (None, Program, ...) step."""
        arrays, out, run = self.arrays, [], []
        order = [t for t in nodes if t.op is not None]
        fused, inside = self._fusions(order) if self.replays else ({}, set())
        if self.replays:
            self._siblings(order, fused, inside)
            self._handoffs(order, fused, inside)
        for t in order:
            if t.id in inside:
                continue   # computed by the fused call at the chain's last node
            srcs = [arrays[s.id] for s in t.srcs]
            result = arrays.get(t.id)
            if self.replays:
                if t.id in fused:
                    run.append(fused[t.id])
                    continue
                if self._free_view(t, result, srcs):
                    continue
                call = self._replay_call(t, result, srcs)
                if call is not None:
                    run.append((call, t.op))
                    continue
                self._flush(run, out)
            out.append((t.op, result, srcs, t.attrs, t if t.id in self.decodes else None))
        self._flush(run, out)
        return out

    def _fusions(self, order):
        """The chains of nodes engine kernels compute together (replay.FUSIONS): each
        node's result read by the next one alone (as its first source), by nothing else,
        and not by the host. A fusion gives its calls with the chain node each runs at
        (where that node's sources are ready); the results in between are never written.
        Returns ({node id: (call, name)}, the ids of the chain nodes that run nothing)."""
        readers: dict[int, list] = {}
        for t in order:
            for src in t.srcs:
                readers.setdefault(src.id, []).append(t)
        fused, inside = {}, set()
        for t in order:
            for ops, fn in replay.FUSIONS.items():
                chain = [t]
                while len(chain) < len(ops) and chain[-1].op == ops[len(chain) - 1]:
                    a = chain[-1]
                    nxt = readers.get(a.id, [])
                    if (len(nxt) != 1 or self._readers.get(a.id) != 1 or a.id in self._pinned
                            or nxt[0].srcs[0] is not a):
                        break
                    chain.append(nxt[0])
                if (tuple(n.op for n in chain) != ops or any(n.id in self.decodes for n in chain)
                        or any(n.id in inside or n.id in fused for n in chain)):
                    continue
                calls = fn(chain, [self.arrays.get(n.id) for n in chain],
                           [[self.arrays[s.id] for s in n.srcs] for n in chain])
                if calls:
                    at = {chain[i].id: (call, f"{'+'.join(ops)} ({call.kernel})")
                          for i, call in calls}
                    fused.update(at)
                    inside.update(n.id for n in chain if n.id not in at)
        return fused, inside

    def _siblings(self, order, fused: dict, inside: set) -> None:
        """Nodes of an op in replay.SIBLINGS that read the same first source (generation's
        q, k and v of one x), computed by one call at the first one's place (into
        ``fused``). A later node's result is written there directly when no node in between
        reads or writes its memory (the node then runs nothing: ``inside``); else the call
        writes it aside, into memory of its own, and a copy at the node's place moves it
        in (the buffer plan may lend that memory to a value that dies before the node)."""
        groups: dict[tuple, list] = {}
        for i, t in enumerate(order):
            joins = replay.SIBLING_JOINS.get(t.op)
            if (t.op in replay.SIBLINGS and t.srcs and t.id not in fused and t.id not in inside
                    and not (t.id in self.decodes and self.decodes[t.id][0])
                    and isinstance(self.arrays.get(t.id), np.ndarray)
                    and (joins is None or joins(t, [self.arrays.get(s.id) for s in t.srcs]))):
                groups.setdefault((t.op, t.srcs[0].id), []).append(i)
        for (op, _), places in groups.items():
            if len(places) < 2:
                continue
            nodes = [order[i] for i in places]
            source = self.arrays[nodes[0].srcs[0].id]
            outs, aside = [], {}
            for i, t in zip(places, nodes):
                out = self.arrays[t.id]
                clear = i == places[0] or (
                    not np.may_share_memory(out, source)
                    and not any(self._touches(order[j], out) for j in range(places[0] + 1, i)))
                if not clear:
                    aside[t.id] = np.empty_like(out)
                outs.append(aside.get(t.id, out))
            call = replay.SIBLINGS[op](nodes, outs,
                                       [[self.arrays[s.id] for s in n.srcs] for n in nodes])
            if call is None:
                continue
            call.keep.append(list(aside.values()))
            fused[nodes[0].id] = (call, f"{op} x{len(nodes)} ({call.kernel})")
            for t in nodes[1:]:
                if t.id in aside:
                    out = self.arrays[t.id]
                    fused[t.id] = (replay.Call("copy_flat", [out, aside[t.id]], [out.size],
                                               keep=[aside[t.id]]), f"{op} (copy_flat)")
                else:
                    inside.add(t.id)

    def _handoffs(self, order, fused: dict, inside: set) -> None:
        """A forward and its backward paired by replay.HANDOFFS (the fused head's loss and
        its gradient): both engine calls (into ``fused``) share one cell, through which the
        forward hands the backward what the backward would recompute. Paired only where
        the backward reads the forward's sources as its first ones, no node in between
        writes their memory, and no other node of either op lies in between (so at most
        one handed value is held at a time)."""
        for (first, second), pair in replay.HANDOFFS.items():
            forward = None
            for j, t in enumerate(order):
                if t.op not in (first, second):
                    continue
                if t.op == first:
                    forward = (j, t)
                    continue
                if forward is None:
                    continue
                i, f = forward
                forward = None
                shared = [s.id for s in f.srcs]
                if ([s.id for s in t.srcs[:len(shared)]] != shared
                        or any(n.id in fused or n.id in inside for n in (f, t))
                        or any(self._writes(order[k], self.arrays[s])
                               for k in range(i + 1, j) for s in shared)):
                    continue
                calls = [self._replay_call(n, self.arrays.get(n.id),
                                           [self.arrays[s.id] for s in n.srcs]) for n in (f, t)]
                if None in calls:
                    continue
                cell = np.zeros(replay.HANDOFF_BYTES, np.uint8)
                pair(*calls, cell)
                for n, call in zip((f, t), calls):
                    call.keep.append(cell)
                    fused[n.id] = (call, n.op)

    def _writes(self, t, memory) -> bool:
        """Whether node ``t`` may write ``memory``: its result's bounds, and an in-place op's
        operands (decoding blocks writes the plan's scratch, which is no tensor's memory)."""
        written = [self.arrays.get(t.id)]
        if groups.member(t.op, groups.IN_PLACE):
            written += [self.arrays.get(s.id) for s in t.srcs]
        return isinstance(memory, np.ndarray) and any(
            isinstance(a, np.ndarray) and np.may_share_memory(a, memory) for a in written)

    def _touches(self, t, memory: np.ndarray) -> bool:
        """Whether node ``t`` reads or writes ``memory`` (by its arrays' bounds; a node that
        decodes blocks into the plan's scratch counts as touching everything)."""
        if t.id in self.decodes:
            return True
        arrays = [self.arrays.get(t.id)] + [self.arrays.get(s.id) for s in t.srcs]
        return any(isinstance(a, np.ndarray) and np.may_share_memory(a, memory) for a in arrays)

    @staticmethod
    def _free_view(t, result, srcs) -> bool:
        """A view node whose buffer the plan made a view of its source: nothing to run
        (its numpy kernel checks the same and returns)."""
        return (groups.member(t.op, groups.VIEW) and isinstance(result, np.ndarray)
                and isinstance(srcs[0], np.ndarray) and np.may_share_memory(result, srcs[0]))

    def _replay_call(self, t, result, srcs):
        """The engine call of node ``t``, or None where it keeps its numpy kernel: no
        replay for its op, one the replay does not take, or a node whose quantized
        sources are decoded into the scratch first."""
        fn = replay.REPLAYS.get(t.op)
        if fn is None or (t.id in self.decodes and self.decodes[t.id][0]):
            return None
        return fn(t, result, srcs, t.attrs)

    @staticmethod
    def _flush(run: list, steps: list) -> None:
        """The pending run of engine calls as one step, if there is one."""
        if run:
            calls, ops = zip(*run)
            steps.append((None, replay.Program(list(calls), list(ops)), None, None, None))
            run.clear()

    def _run_with_blocks(self, t, srcs):
        layout, views = self.decodes[t.id]
        if not layout:
            self._block_kernel(t, srcs, views)
            return
        self._decode(layout, views)
        srcs = [views[s.id][1] if s.id in views else a for s, a in zip(t.srcs, srcs)]
        KERNELS[t.op](self.arrays.get(t.id), srcs, t.attrs)

    def _block_kernel(self, t, srcs, scratch):
        """Run ``t``'s block kernel (its decodes are not in ``decode_seconds``: they are
        interleaved with its GEMMs); one that decodes into the scratch overwrites what the
        scratch held."""
        BLOCK_KERNELS[t.op][0](self.arrays.get(t.id), srcs, t.attrs, scratch)
        if scratch is not None:
            self._held = None

    def _decode(self, layout: dict, views: dict):
        """Decode the quantized consts of one node into its scratch views, unless the
        scratch holds exactly them already."""
        if layout == self._held:
            return
        t0 = time.perf_counter()
        for cid, (fill, _) in views.items():
            self.arrays[cid].decode_into(fill)
        self._held = layout
        self.decode_seconds += time.perf_counter() - t0

    def write(self, t, value: np.ndarray):
        np.copyto(self.arrays[t.id], value, casting="unsafe")

    def read(self, t) -> np.ndarray:
        a = self.arrays[t.id]
        return np.array(a, self.dtype) if isinstance(a, BlockTensor) else np.array(a)

    def zero(self, t):
        self.arrays[t.id].fill(0)
