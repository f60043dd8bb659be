"""The numpy kernels of the rotary family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel


def rope_angles(positions, dims, base, dtype, freq_factors=None, freq_scale=1.0):
    """cos and sin of freq_scale * pos * base^(-2i/dims) / freq_factors[i], shaped
    [batch, seq, 1, dims/2] (ggml's rope angle with frequency factors and linear scaling)."""
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    theta = positions.astype(np.float64)[..., None] * inv_freq
    theta *= freq_scale  # exact at the default 1.0
    return np.cos(theta)[:, :, None, :].astype(dtype), np.sin(theta)[:, :, None, :].astype(dtype)


#: Angles of the last few small position sets (generation: every layer's q and k rope at
#: the one new position, so each token's angles are worked out once, not 2 x layers times).
_RECENT_ANGLES: dict = {}

_SMALL_POSITIONS = 256


def _angles(pos, d, base, dtype, factors, freq_scale):
    if pos.size > _SMALL_POSITIONS:
        return rope_angles(pos, d, base, dtype, factors, freq_scale)
    key = (pos.shape, pos.tobytes(), d, base, np.dtype(dtype).str, freq_scale,
           None if factors is None else factors.tobytes())
    hit = _RECENT_ANGLES.get(key)
    if hit is None:
        if len(_RECENT_ANGLES) >= 8:
            _RECENT_ANGLES.pop(next(iter(_RECENT_ANGLES)))
        hit = _RECENT_ANGLES[key] = rope_angles(pos, d, base, dtype, factors, freq_scale)
    return hit


#: The complex rotations of the recent angles (generation: q and k of every layer share one).
_RECENT_ROTATIONS: dict = {}


def _rotation(cos, sin, inverse: bool, ctype, kept: bool):
    """cos + i sin (sin negated when ``inverse``) as ``ctype``; ``kept``: the angles are
    _angles' kept ones (the same arrays come back, so their id is a key), and so is this."""
    key = (id(cos), inverse, ctype)
    hit = _RECENT_ROTATIONS.get(key) if kept else None
    if hit is not None and hit[0] is cos:
        return hit[1]
    rot = (cos + 1j * (-sin if inverse else sin)).astype(ctype)
    if kept:
        if len(_RECENT_ROTATIONS) >= 16:
            _RECENT_ROTATIONS.pop(next(iter(_RECENT_ROTATIONS)))
        _RECENT_ROTATIONS[key] = (cos, rot)
    return rot


@kernel("rope")
def _rope_numpy(out, srcs, attrs):
    x, pos = srcs[:2]
    d = attrs["dims"]
    factors = srcs[2] if len(srcs) == 3 else None
    cos, sin = _angles(pos, d, attrs["base"], x.dtype, factors, attrs["freq_scale"])
    if attrs["mode"] == "normal" and d == x.shape[-1] and x.flags.c_contiguous:
        # Adjacent pairs (x0, x1) are the complex number x0 + i x1, and rotating by theta
        # is one complex multiply: a third of the strided real arithmetic below.
        ctype = np.complex64 if x.dtype == np.float32 else np.complex128
        rot = _rotation(cos, sin, attrs["inverse"], ctype, pos.size <= _SMALL_POSITIONS)
        np.multiply(x.view(ctype), rot, out=out.view(ctype))
        return
    if attrs["inverse"]:
        sin = -sin
    if attrs["mode"] == "normal":
        x0, x1, o0, o1 = x[..., 0:d:2], x[..., 1:d:2], out[..., 0:d:2], out[..., 1:d:2]
    else:
        h = d // 2
        x0, x1, o0, o1 = x[..., :h], x[..., h:d], out[..., :h], out[..., h:d]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    o0[...], o1[...] = r0, r1
    out[..., d:] = x[..., d:]
