"""The CUDA lowering of the collective family (its ops and their rules are in __init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import Collective, Launch, i32_arg, lowers, ptr_arg


@lowers("all_reduce", kernels=("tg_copy",))
def _all_reduce(node, at):
    """A Collective (no kernel: the context enqueues it on the session's stream, a real GPU
    as one ncclAllReduce per buffer in an NCCL group, the host device through MPI), then a
    tg_copy of the summed count into the node's output. Both go on the one stream, so graph
    capture records them like any launch and the replayed step includes the reduction."""
    buffers = tuple((at.ptr(s), s.size) for s in node.srcs)
    return [Collective(buffers, node.attrs["ranks"]),
            Launch("tg_copy", (1, 1, 1), [ptr_arg(at.out), ptr_arg(at.ptr(node.srcs[0])),
                                          i32_arg(1)])]
