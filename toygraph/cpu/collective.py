"""The numpy backend's collective: ``all_reduce`` (ops_collective.py) through MPI.

The sources are summed over the ranks in place with one MPI Allreduce per step (see
``World.sum_arrays``). Nothing here imports mpi4py: ``distributed.world()`` does, and only
in a job of several ranks.
"""
from __future__ import annotations

from ..distributed import world_of
from .registry import kernel


@kernel("all_reduce")
def _all_reduce(out, srcs, attrs):
    world_of(attrs["ranks"]).sum_arrays(srcs, "the all-reduce of the step's gradients")
    out[...] = srcs[0]
