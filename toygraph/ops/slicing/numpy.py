"""The numpy kernels of the slicing family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.table import kernel


@kernel("narrow")
def _narrow_numpy(out, srcs, attrs):
    s = attrs["start"]
    out[...] = srcs[0][..., s:s + attrs["length"]]


@kernel("narrow_back")
def _narrow_back_numpy(out, srcs, attrs):
    g, s = srcs[0], attrs["start"]
    out.fill(0)
    out[..., s:s + g.shape[-1]] = g
