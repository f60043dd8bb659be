"""The update family's engine replay (cpu.h beside this): accumulate, global_norm and adamw
on f32 arrays."""
from __future__ import annotations

import numpy as np

from toygraph.cpu.replay import Call, addresses, f32_contiguous, replays
from toygraph.ops.update import adamw_groups


@replays("accumulate")
def _accumulate(node, out, srcs, attrs):
    acc, value = srcs
    if f32_contiguous(acc, value) and acc.shape == value.shape:
        return Call("accumulate", [acc, value], [acc.size])


@replays("global_norm")
def _global_norm(node, out, srcs, attrs):
    *grads, divisor = srcs
    if f32_contiguous(out, divisor, *grads):
        ptrs, sizes = addresses(grads), np.array([g.size for g in grads], np.int64)
        return Call("global_norm", [out, ptrs, sizes, divisor], [len(grads)], keep=[ptrs, sizes])


@replays("adamw")
def _adamw(node, out, srcs, attrs):
    groups, (hp, norm, divisor) = adamw_groups(srcs)
    if not f32_contiguous(hp, norm, divisor, *(a for g in groups for a in g)):
        return None
    lists = [addresses(a) for a in zip(*groups)]           # params, grads, m, v
    sizes = np.array([w.size for w, _, _, _ in groups], np.int64)
    scales = np.array(attrs["lr_scales"], np.float64)
    return Call("adamw", [*lists, sizes, scales, hp, norm, divisor], [len(groups)],
                [attrs["max_norm"]], keep=[*lists, sizes, scales])
