"""The deltanet family's engine replay (cpu.h beside this): causal_conv1d and its backward,
delta_rule (with or without a given state) and its backward, on C-contiguous f32
operands; anything else keeps the numpy kernel."""
from __future__ import annotations

from toygraph.cpu.replay import Call, f32_contiguous, replays

#: The longest chunk the delta rule's kernels take: their scratch per (batch, head) holds
#: a few [chunk, chunk] matrices.
MAX_CHUNK = 1024


def _conv_shape(x, w):
    """(B, T, C, K) when x is [B, T, C] and w [C, K], else None."""
    if x.ndim == 3 and w.ndim == 2 and w.shape[0] == x.shape[2]:
        return [*x.shape, w.shape[1]]
    return None


@replays("causal_conv1d")
def _conv(node, out, srcs, attrs):
    x, w = srcs
    dims = _conv_shape(x, w) if f32_contiguous(out, x, w) else None
    if dims is not None and out.shape == x.shape:
        return Call("causal_conv1d", [out, x, w], dims)


@replays("causal_conv1d_back")
def _conv_back(node, out, srcs, attrs):
    x, w, g = srcs
    dims = _conv_shape(x, w) if f32_contiguous(out, x, w, g) else None
    if dims is not None and g.shape == x.shape and out.size == x.size + w.size:
        return Call("causal_conv1d_back", [out, x, w, g], dims)


def _delta_dims(srcs, attrs):
    """[B, T, H, dk, dv, chunk] when q, k, v, g, beta have the op's shapes (and every
    source is C-contiguous f32), else None."""
    q, k, v, g, beta = srcs[:5]
    if not (f32_contiguous(*srcs) and q.ndim == 4 and v.ndim == 4 and k.shape == q.shape):
        return None
    B, T, H, dk = q.shape
    if v.shape[:3] != (B, T, H) or g.shape != (B, T, H) or beta.shape != (B, T, H):
        return None
    if not 1 <= attrs["chunk"] <= MAX_CHUNK:
        return None
    return [B, T, H, dk, v.shape[3], attrs["chunk"]]


@replays("delta_rule")
def _delta(node, out, srcs, attrs):
    dims = _delta_dims(srcs, attrs) if len(srcs) in (5, 6) else None
    if dims is None or not f32_contiguous(out):
        return None
    B, T, H, dk, dv, _ = dims
    state = srcs[5] if len(srcs) == 6 else None
    want = B * T * H * dv + (B * H * dk * dv if state is not None else 0)
    if state is not None and state.shape != (B, H, dk, dv):
        return None
    if out.size == want:
        return Call("delta_rule", [out, *srcs[:5], state], dims)


@replays("delta_rule_back")
def _delta_back(node, out, srcs, attrs):
    dims = _delta_dims(srcs, attrs) if len(srcs) == 6 else None
    if dims is None or not f32_contiguous(out) or srcs[5].shape != srcs[2].shape:
        return None
    if out.size == sum(s.size for s in srcs[:5]):
        return Call("delta_rule_back", [out, *srcs], dims)
