"""The numpy kernels of the policy family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel


def _ratio_and_clipped(logp, old, adv, lo, hi):
    r = np.exp(logp - old)
    return r, ((r > hi) & (adv > 0)) | ((r < lo) & (adv < 0))


@kernel("clipped_surrogate")
def _clipped_surrogate_numpy(out, srcs, attrs):
    logp, old, adv = srcs
    r = np.exp(logp - old)
    np.negative(np.minimum(r * adv, np.clip(r, attrs["lo"], attrs["hi"]) * adv), out=out)


@kernel("clipped_surrogate_back")
def _clipped_surrogate_back_numpy(out, srcs, attrs):
    logp, old, adv, g = srcs
    r, clipped = _ratio_and_clipped(logp, old, adv, attrs["lo"], attrs["hi"])
    out[...] = np.where(clipped, 0.0, -(r * adv) * g)


@kernel("kl_penalty")
def _kl_penalty_numpy(out, srcs, attrs):
    d = srcs[1] - srcs[0]
    out[...] = np.expm1(d) - d


@kernel("kl_penalty_back")
def _kl_penalty_back_numpy(out, srcs, attrs):
    logp, ref, g = srcs
    out[...] = -np.expm1(ref - logp) * g
