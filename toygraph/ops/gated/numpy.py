"""The numpy kernels of the gated family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.gated import ACTS, up_offset
from toygraph.ops.table import kernel


@kernel("glu")
def _glu_numpy(out, srcs, attrs):
    gate, up = srcs
    ACTS[attrs["act"]][1](out, [gate], attrs)   # act(gate), as the activation op rounds it
    np.multiply(out, up, out=out)


@kernel("glu_back")
def _glu_back_numpy(out, srcs, attrs):
    """d gate = act_back(gate, g * up), d up = g * act(gate): the mul's and the
    activation's backward kernels on the same values."""
    gate, up, g = srcs
    n = gate.size
    _, forward, backward = ACTS[attrs["act"]]
    d_gate = out[:n].reshape(gate.shape)
    d_up = out[up_offset(n):up_offset(n) + n].reshape(up.shape)
    np.multiply(g, up, out=d_up)                # g * up, parked where d up goes
    backward(d_gate, [gate, d_up], attrs)
    forward(d_up, [gate], attrs)
    np.multiply(g, d_up, out=d_up)
