"""The norm family's engine replay (cpu.h beside this): rms_norm (its weight [d] or of x's
shape) and rms_norm_back (its weight [d]), softmax (scaled, causal or not), softmax_back
and inv_row_norm, over the last axis of f32 arrays."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays


def _rows(x):
    d = x.shape[-1] if x.ndim else 1
    return x.size // max(d, 1), d


def _weight_fits(w, d) -> bool:
    return w is None or (f32_contiguous(w) and w.shape == (d,))


@replays("rms_norm")
def _rms_norm(node, out, srcs, attrs):
    """A weight of x's shape (the weight gradient's recomputed x r, weighted by g) is read
    a row of it per row of x."""
    x = srcs[0]
    w = srcs[1] if len(srcs) == 2 else None
    rows, d = _rows(x)
    full = w is not None and f32_contiguous(w) and w.shape == x.shape
    if f32_contiguous(out, x) and d and (full or _weight_fits(w, d)):
        return Call("rms_norm", [out, x, w], [rows, d, d if full else 0], [attrs["eps"]])


@replays("rms_norm_back")
def _rms_norm_back(node, out, srcs, attrs):
    x, g = srcs[:2]
    base = 2 + attrs["weighted"]
    w = srcs[2] if attrs["weighted"] else None
    add = srcs[base] if len(srcs) > base else None
    rows, d = _rows(x)
    if (f32_contiguous(out, x, g) and d and _weight_fits(w, d) and g.shape == x.shape
            and (add is None or (f32_contiguous(add) and add.shape == x.shape))):
        return Call("rms_norm_back", [out, x, g, w, add], [rows, d], [attrs["eps"]])


@replays("softmax")
def _softmax(node, out, srcs, attrs):
    x = srcs[0]
    rows, d = _rows(x)
    if f32_contiguous(out, x) and d and x.ndim >= 1:
        return Call("softmax", [out, x], [rows, d, attrs["causal"]], [attrs["scale"]])


@replays("softmax_back")
def _softmax_back(node, out, srcs, attrs):
    y, g = srcs
    rows, d = _rows(y)
    if f32_contiguous(out, y, g) and d and g.shape == y.shape:
        return Call("softmax_back", [out, y, g], [rows, d], [attrs["scale"]])


@replays("inv_row_norm")
def _inv_row_norm(node, out, srcs, attrs):
    x = srcs[0]
    rows, d = _rows(x)
    if f32_contiguous(out, x) and d and out.size == rows:
        return Call("inv_row_norm", [out, x], [rows, d])
