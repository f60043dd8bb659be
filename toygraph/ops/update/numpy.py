"""The numpy kernels of the update family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel
from toygraph.ops.update import adamw_groups


@kernel("accumulate")
def _accumulate_numpy(out, srcs, attrs):
    acc, value = srcs
    acc += value


@kernel("global_norm")
def _global_norm_numpy(out, srcs, attrs):
    *grads, divisor = srcs
    # Accumulate in float64 so the norm does not depend on how many tensors there are.
    sq = 0.0
    for g in grads:
        g64 = g.ravel().astype(np.float64)
        sq += float(np.dot(g64, g64))
    out[...] = np.sqrt(sq) / max(float(divisor), 1.0)


@kernel("adamw")
def _adamw_numpy(out, srcs, attrs):
    groups, (hp, norm, divisor) = adamw_groups(srcs)
    for (w, g, m, v), scale in zip(groups, attrs["lr_scales"]):
        _adamw_one(w, g, m, v, hp, norm, divisor, attrs["max_norm"], scale)


def _adamw_one(w, g, m, v, hp, norm, divisor, max_norm, lr_scale):
    lr, b1, b2, eps, wd, b1h, b2h = (w.dtype.type(h) for h in hp[:7])
    lr = lr * w.dtype.type(lr_scale)
    coef = 1.0 / max(float(divisor), 1.0)
    if max_norm > 0 and float(norm) > max_norm:
        coef *= max_norm / float(norm)
    gs = g * w.dtype.type(coef)
    m *= b1
    m += (1 - b1) * gs
    v *= b2
    v += (1 - b2) * gs * gs
    w *= 1 - lr * wd
    w -= lr * (m * b1h) / (np.sqrt(v * b2h) + eps)
