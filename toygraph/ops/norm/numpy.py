"""The numpy kernels of the norm family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel


def _rms_inv(x, eps):
    # np.mean's own two calls (its sum, then a true_divide by the count as an intp) without
    # its Python wrapper: the same bits, ~10 us less a call (61 calls a generated token)
    ms = np.add.reduce(x * x, axis=-1, keepdims=True)
    np.true_divide(ms, np.intp(x.shape[-1]), out=ms, casting="unsafe")
    return 1.0 / np.sqrt(ms + eps)


@kernel("rms_norm")
def _rms_norm_numpy(out, srcs, attrs):
    np.multiply(srcs[0], _rms_inv(srcs[0], attrs["eps"]), out=out)
    if len(srcs) == 2:   # (x r) w: the product of the rounded x r, as a mul after it
        np.multiply(out, srcs[1], out=out)


@kernel("rms_norm_back")
def _rms_norm_back_numpy(out, srcs, attrs):
    """r (g - y mean(g y)), y = x r, g times the weight first when weighted; plus the last
    source when there is one to add (as the add op adds: one rounding, and the sum's order
    does not change it)."""
    x, g = srcs[:2]
    base = 2 + attrs["weighted"]
    if attrs["weighted"]:
        g = g * srcs[2]
    r = _rms_inv(x, attrs["eps"])
    y = x * r
    out[...] = r * (g - y * np.mean(g * y, axis=-1, keepdims=True))
    if len(srcs) > base:
        np.add(out, srcs[base], out=out)


def _causal_mask(t):
    return np.triu(np.ones((t, t), bool), k=1)


@kernel("softmax")
def _softmax_numpy(out, srcs, attrs):
    z = srcs[0] * out.dtype.type(attrs["scale"])
    if attrs["causal"]:
        z[..., _causal_mask(z.shape[-1])] = -np.inf
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    np.divide(z, z.sum(axis=-1, keepdims=True), out=out)


@kernel("softmax_back")
def _softmax_back_numpy(out, srcs, attrs):
    y, g = srcs
    out[...] = attrs["scale"] * y * (g - np.sum(g * y, axis=-1, keepdims=True))


@kernel("inv_row_norm")
def _inv_row_norm_numpy(out, srcs, attrs):
    x = srcs[0]
    out[...] = 1.0 / np.sqrt(np.sum(x * x, axis=-1))
