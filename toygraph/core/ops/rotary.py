"""Rotary position embedding ("normal" and "neox" layouts, optional frequency factors and
linear scaling): builder, shape rule, backward rule (the inverse rotation), numpy kernel
and CUDA lowering (rotary.cu)."""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.table import F32, I32, INT32_MAX, check, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f64_arg, grid_1d, i32_arg, lowers,
                                    ptr_arg)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "rotary.cu")


def rope(x, positions, *, dims: int, base: float, mode: str = "normal", freq_factors=None,
         freq_scale: float = 1.0, inverse=False):
    """Rotary embedding of x [batch, seq, heads, head_dim] at positions [batch, seq].

    mode "normal" rotates adjacent pairs (2i, 2i+1), as llama.cpp does for the Q/K rows a
    GGUF stores; "neox" rotates (i, i + dims/2), as Hugging Face and Qwen2 GGUFs do. Only
    the first ``dims`` features of each head rotate.

    Pair i at position p turns by ``freq_scale * p * base^(-2i/dims) / freq_factors[i]``,
    as in ggml's rope: ``freq_factors`` is an f32 [dims/2] tensor (a Llama-3 GGUF's
    ``rope_freqs.weight``, which is how llama.cpp's converter encodes rope_type "llama3"),
    a third source that gets no gradient; ``freq_scale`` is linear rope scaling
    (1 / ``rope.scaling.factor``). The defaults leave the angles untouched.
    """
    srcs = [x, positions] + ([] if freq_factors is None else [freq_factors])
    return make_node("rope", srcs, dims=int(dims), base=float(base), mode=mode,
                     freq_scale=float(freq_scale), inverse=bool(inverse))


def _infer_rope(shapes, dtypes, attrs):
    (xs, ps), (xd, pd) = shapes[:2], dtypes[:2]
    check(xd == F32 and pd == I32, "rope needs f32 x and i32 positions")
    check(len(xs) == 4, f"x must be [batch, seq, heads, head_dim], got {xs}")
    check(tuple(ps) == tuple(xs[:2]), f"positions must be {xs[:2]}, got {ps}")
    check(attrs["mode"] in ("normal", "neox"),
          f"mode must be normal or neox, got {attrs['mode']!r}")
    d = attrs["dims"]
    check(0 < d <= xs[3] and d % 2 == 0, f"rope dims must be even and <= {xs[3]}, got {d}")
    check(attrs["freq_scale"] > 0, f"freq_scale must be positive, got {attrs['freq_scale']}")
    if len(shapes) == 3:
        check(dtypes[2] == F32 and tuple(shapes[2]) == (d // 2,),
              f"freq_factors must be f32 [{d // 2}] (dims / 2), got {dtypes[2]} {shapes[2]}")
    return xs, F32


def _grad_rope(n, g, need):
    a = n.attrs
    factors = n.srcs[2] if len(n.srcs) == 3 else None
    dx = rope(g, n.srcs[1], dims=a["dims"], base=a["base"], mode=a["mode"],
              freq_factors=factors, freq_scale=a["freq_scale"], inverse=not a["inverse"])
    return [dx] + [None] * (len(n.srcs) - 1)


define_op("rope", _infer_rope, _grad_rope,
    id_ranges=lambda n: {1: (0, INT32_MAX, "positions")})


# --- numpy kernel ------------------------------------------------------------------------------
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


# --- CUDA lowering (rotary.cu) ----------------------------------------------------------------
@lowers("rope", kernels=("tg_rope",), bf16_reads=(0,), bf16_writes=True)
def _rope(node, at):
    """A null factors pointer: no frequency factors. x and the output may be kept in bf16
    (the bf16 mask's bits 0 and 16)."""
    s, a = node.srcs, node.attrs
    B, S, H, D = s[0].shape
    factors = at.ptr(s[2]) if len(s) == 3 else 0
    return [Launch("tg_rope", grid_1d(node.size),
                   [ptr_arg(at.out), ptr_arg(at.ptr(s[0])), ptr_arg(at.ptr(s[1])),
                    ptr_arg(factors), i32_arg(node.size), i32_arg(H), i32_arg(D),
                    i32_arg(a["dims"]), f64_arg(a["base"]), f64_arg(a["freq_scale"]),
                    i32_arg(a["mode"] == "neox"), i32_arg(a["inverse"]),
                    i32_arg(at.bf16_mask(node, s[:1]))])]
