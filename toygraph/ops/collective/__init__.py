"""The collective op: ``all_reduce``, the data-parallel sum of gradients over ranks.

>>> divisor = all_reduce([count_acc, *grad_accs], ranks=2)    # doctest: +SKIP
>>> adamw(w, grad_acc, m, v, hp, norm, divisor, max_norm=1.0)  # doctest: +SKIP

The node sums each of its sources over the ranks of the job **in place** (they are the
accumulated gradient and token-count state buffers) and its value is the summed first
source, the global token count. The clip and AdamW nodes read that value as their
divisor, so they are ordered after the reduction by an ordinary data dependency and the
whole step, reduction included, stays one replayed graph. It has no gradient: it lives
in the optimizer tail, after backward. Builder, shape rule, numpy kernel (MPI Allreduce
through mpi4py, toygraph/distributed.py) and CUDA lowering (a :class:`Collective` step:
ncclAllReduce on the session's stream, cuda/nccl.py; MPI on the host device).
"""
from __future__ import annotations

from toygraph.ops.table import F32, check, check_floats, define_op, make_node


def all_reduce(tensors, *, ranks: int):
    """Sum every tensor of ``tensors`` over ``ranks`` ranks, in place; the value is the
    summed ``tensors[0]``, which must be a scalar (the token count the update divides by)."""
    return make_node("all_reduce", list(tensors), ranks=int(ranks))


def _infer_all_reduce(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(len(shapes) >= 1 and shapes[0] == (), "the first operand must be a scalar count")
    check(isinstance(attrs["ranks"], int) and attrs["ranks"] >= 1, "ranks must be >= 1")
    return (), F32


define_op("all_reduce", _infer_all_reduce)
