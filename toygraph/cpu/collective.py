"""The numpy backend's collective: ``all_reduce`` (ops_collective.py) through MPI.

The sources are packed into one contiguous buffer so the job makes one MPI Allreduce per
step, not one per gradient; the sum is written back into them in place. Nothing here
imports mpi4py: ``distributed.world()`` does, and only in a job of several ranks.
"""
from __future__ import annotations

import numpy as np

from ..distributed import DistributedError, world
from .registry import kernel


@kernel("all_reduce")
def _all_reduce(out, srcs, attrs):
    w = world()
    if w.size != attrs["ranks"]:
        raise DistributedError(f"this graph sums gradients over {attrs['ranks']} ranks but the "
                               f"job has {w.size}: realize it in the job that runs it")
    flat = np.concatenate([s.reshape(-1) for s in srcs])
    w.sum_inplace(flat, "the all-reduce of the step's gradients")
    offset = 0
    for s in srcs:
        np.copyto(s, flat[offset:offset + s.size].reshape(s.shape))
        offset += s.size
    out[...] = srcs[0]
