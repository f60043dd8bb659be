"""The numpy kernels of the collective family (the reference backend; its ops and their rules are
in __init__.py)."""
from __future__ import annotations

from toygraph.ops.table import kernel


@kernel("all_reduce")
def _all_reduce_numpy(out, srcs, attrs):
    """One MPI Allreduce per step (``World.sum_arrays``); mpi4py is imported only in a job
    of several ranks, by ``distributed.world()``."""
    from toygraph.distributed import world_of
    world_of(attrs["ranks"]).sum_arrays(srcs, "the all-reduce of the step's gradients")
    out[...] = srcs[0]
