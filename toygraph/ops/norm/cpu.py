"""The norm family's engine replay (cpu.h beside this): rms_norm and rms_norm_back over the
last axis of f32 arrays, the weight (when there is one) over that axis."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays


def _rows(x):
    d = x.shape[-1] if x.ndim else 1
    return x.size // max(d, 1), d


def _weight_fits(w, d) -> bool:
    return w is None or (f32_contiguous(w) and w.shape == (d,))


@replays("rms_norm")
def _rms_norm(node, out, srcs, attrs):
    x = srcs[0]
    w = srcs[1] if len(srcs) == 2 else None
    rows, d = _rows(x)
    if f32_contiguous(out, x) and d and _weight_fits(w, d):
        return Call("rms_norm", [out, x, w], [rows, d], [attrs["eps"]])


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
