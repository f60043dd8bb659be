"""The numpy kernels of the elementwise family (the reference backend; its ops and their rules are
in __init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel


@kernel("add")
def _add_numpy(out, srcs, attrs):
    np.add(srcs[0], srcs[1], out=out)


@kernel("sub")
def _sub_numpy(out, srcs, attrs):
    np.subtract(srcs[0], srcs[1], out=out)


@kernel("mul")
def _mul_numpy(out, srcs, attrs):
    np.multiply(srcs[0], srcs[1], out=out)


@kernel("scale")
def _scale_numpy(out, srcs, attrs):
    np.multiply(srcs[0], out.dtype.type(attrs["s"]), out=out)


@kernel("silu")
def _silu_numpy(out, srcs, attrs):
    x = srcs[0]
    # x / (1 + exp(-x)): exp overflows to inf for x < -88 and the quotient is then the
    # correct limit -0, so the overflow warning is silenced rather than branched around.
    with np.errstate(over="ignore"):
        np.exp(-x, out=out)
    out += 1
    np.divide(x, out, out=out)


@kernel("silu_back")
def _silu_back_numpy(out, srcs, attrs):
    x, g = srcs
    with np.errstate(over="ignore"):
        s = np.exp(-x)
    s += 1
    np.reciprocal(s, out=s)                 # sigmoid(x)
    np.subtract(1, s, out=out)
    out *= x
    out += 1                                # 1 + x (1 - s)
    out *= s
    out *= g


# GELU, tanh approximation (torch's approximate="tanh"): 0.5 x (1 + tanh(c (x + a x^3))).
_GELU_C, _GELU_A = np.sqrt(2.0 / np.pi), 0.044715


def _gelu_tanh(x):
    return np.tanh(x.dtype.type(_GELU_C) * (x + x.dtype.type(_GELU_A) * x * x * x))


@kernel("gelu")
def _gelu_numpy(out, srcs, attrs):
    x = srcs[0]
    np.multiply(x, 0.5 * (1 + _gelu_tanh(x)), out=out)


@kernel("gelu_back")
def _gelu_back_numpy(out, srcs, attrs):
    """d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), t = tanh(c (x + a x^3))."""
    x, g = srcs
    t = _gelu_tanh(x)
    c, a = x.dtype.type(_GELU_C), x.dtype.type(3 * _GELU_A)
    out[...] = g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + a * x * x))


def _sigmoid(x):
    """As tg_sigmoid computes it: exp of -|x| only, so neither side overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


@kernel("sigmoid")
def _sigmoid_numpy(out, srcs, attrs):
    out[...] = _sigmoid(srcs[0])


@kernel("sigmoid_back")
def _sigmoid_back_numpy(out, srcs, attrs):
    """d/dx = s (1 - s)."""
    x, g = srcs
    s = _sigmoid(x)
    out[...] = g * s * (1 - s)


@kernel("softcap")
def _softcap_numpy(out, srcs, attrs):
    """In place in ``out`` (the same operations as tanh(x / c) * c): the Gemma 4 head's
    logits are [tokens, 262144], where temporaries cost more than the tanh."""
    c = srcs[0].dtype.type(attrs["cap"])
    np.divide(srcs[0], c, out=out)
    np.tanh(out, out=out)
    np.multiply(out, c, out=out)


@kernel("softcap_back")
def _softcap_back_numpy(out, srcs, attrs):
    """d/dx = 1 - t^2, t = tanh(x / cap); one temporary (``out`` may share g's memory)."""
    x, g = srcs
    t = np.divide(x, x.dtype.type(attrs["cap"]))
    np.tanh(t, out=t)
    np.multiply(t, t, out=t)
    np.subtract(1, t, out=t)
    np.multiply(g, t, out=out)


def _swiglu_oai_parts(gate, up, attrs):
    """(clamped gate, clamped up, sigmoid(alpha * clamped gate))."""
    gc = np.minimum(gate, gate.dtype.type(attrs["limit"]))
    uc = np.clip(up, -attrs["limit"], attrs["limit"]).astype(up.dtype)
    with np.errstate(over="ignore"):
        s = 1 / (1 + np.exp(-gate.dtype.type(attrs["alpha"]) * gc))
    return gc, uc, s


@kernel("swiglu_oai")
def _swiglu_oai_numpy(out, srcs, attrs):
    gc, uc, s = _swiglu_oai_parts(*srcs, attrs)
    out[...] = gc * s * (uc + 1)


@kernel("swiglu_oai_back")
def _swiglu_oai_back_numpy(out, srcs, attrs):
    """d gate = g (u + 1) (s + alpha g s (1 - s)) where gate <= limit; d up = g * glu where
    |up| <= limit."""
    gate, up, g = srcs
    gc, uc, s = _swiglu_oai_parts(gate, up, attrs)
    limit = attrs["limit"]
    if attrs["wrt"] == 0:
        out[...] = np.where(gate <= limit, g * (uc + 1) * (s + attrs["alpha"] * gc * s * (1 - s)), 0)
    else:
        out[...] = np.where(np.abs(up) <= limit, g * (gc * s), 0)
