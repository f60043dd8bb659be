"""NCCL for the CUDA backend's ``all_reduce`` (ops/collective/), through nccl4py.

>>> comm = communicator(ranks=2)                      # doctest: +SKIP
>>> all_reduce(comm, [(dptr, n)], stream_handle)      # doctest: +SKIP

nccl4py is imported on first use only (a job of one rank that never builds the op never
imports it). The communicator spans the ranks of ``distributed.world()``: rank 0 makes the
NCCL unique id and MPI broadcasts it. Each rank's GPU is the context current when the
communicator is made (``TOYGRAPH_CUDA_DEVICE``, or the rank's local rank on its node).
The calls are enqueued on the session's stream, so stream capture puts them in the CUDA
graph, which NCCL supports.
"""
from __future__ import annotations

from toygraph.distributed import world_of
from toygraph.errors import CudaError

_COMMS: dict[int, object] = {}


def _nccl():
    try:
        import nccl.bindings.nccl as bindings
        import nccl.core as core
    except ImportError as e:
        raise CudaError(f"the cuda backend's all_reduce needs NCCL: pip install "
                        f"'toygraph[cuda]' (nccl4py and nvidia-nccl-cu13): {e}") from None
    return core, bindings


def communicator(ranks: int):
    """This process's NCCL communicator over the job's ``ranks`` ranks (made once)."""
    if ranks in _COMMS:
        return _COMMS[ranks]
    w = world_of(ranks)
    core, _ = _nccl()
    uid, why = b"", ""
    if w.rank == 0:
        try:
            uid = bytes(core.get_unique_id())  # nccl4py 0.6: as_bytes is a property
        except Exception as e:  # e.g. libnccl.so missing; the others learn it from the broadcast
            why = f": {' '.join(str(e).split())}"
    uid = w.bcast_bytes(uid)  # empty: rank 0 failed, and every rank says so below
    try:
        if not uid:
            raise CudaError(f"rank 0 could not make the NCCL unique id{why}")
        comm = core.Communicator.init(ranks, w.rank, core.UniqueId.from_bytes(uid))
    except Exception as e:  # nccl4py's NCCLError and friends: one line, naming the step
        raise CudaError(f"NCCL communicator over {ranks} rank(s) failed to start: "
                        f"{' '.join(str(e).split())}") from None
    _COMMS[ranks] = comm
    return comm


def all_reduce(comm, buffers, stream: int) -> None:
    """Enqueue an in-place f32 sum of every ``(address, count)`` on ``stream``."""
    core, b = _nccl()
    b.group_start()
    try:
        for addr, count in buffers:
            b.all_reduce(int(addr), int(addr), int(count), int(core.FLOAT32), int(core.SUM),
                         comm._comm, int(stream))
    finally:
        b.group_end()
