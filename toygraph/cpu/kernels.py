"""numpy kernels, one per op of ops.py: ``kernel(out, srcs, attrs)`` writes into ``out``.

Everything is vectorised: no Python loops over tokens or heads. Matmuls go to BLAS.
Side-effect kernels (accumulate, adamw) get ``out=None`` and write into their operands.
The fused ops' kernels (attention, linear_cross_entropy; ops_fused.py) are in fused.py;
``KERNELS`` here has them all.
"""
from __future__ import annotations

import numpy as np

from . import cache, fused  # noqa: F401 (register the cache and fused kernels in KERNELS)
from . import pref  # noqa: F401 (registers the preference-loss kernels, ops_pref.py)
from .registry import KERNELS, kernel  # noqa: F401 (KERNELS: the table, for the backend)


# --- broadcasting helpers shared with the grouped-query matmul ----------------------------
def _split_groups(x_shape, small_shape):
    """Reshape plan that turns a grouped reduction into plain sums.

    For each axis where x has s*g entries and the target has s (g > 1, s > 1), split it
    into (s, g). Returns the split shape and the axes to sum to reach the target shape.
    """
    n = len(x_shape)
    small = (1,) * (n - len(small_shape)) + tuple(small_shape)
    split, axes = [], []
    for xd, sd in zip(x_shape, small):
        if xd == sd:
            split.append(xd)
        elif sd == 1:
            axes.append(len(split))
            split.append(xd)
        else:
            split += [sd, xd // sd]
            axes.append(len(split) - 1)
    return split, tuple(axes)


@kernel("sum_to")
def _sum_to(out, srcs, attrs):
    x = srcs[0]
    split, axes = _split_groups(x.shape, out.shape)
    out[...] = x.reshape(split).sum(axis=axes).reshape(out.shape)


@kernel("expand")
def _expand(out, srcs, attrs):
    x = srcs[0]
    small = (1,) * (out.ndim - x.ndim) + x.shape
    y = x.reshape(small)
    for ax, (od, sd) in enumerate(zip(out.shape, small)):
        if od != sd and sd != 1:
            y = np.repeat(y, od // sd, axis=ax)
    out[...] = np.broadcast_to(y, out.shape)


# --- elementwise -----------------------------------------------------------------------------
@kernel("add")
def _add(out, srcs, attrs):
    np.add(srcs[0], srcs[1], out=out)


@kernel("sub")
def _sub(out, srcs, attrs):
    np.subtract(srcs[0], srcs[1], out=out)


@kernel("mul")
def _mul(out, srcs, attrs):
    np.multiply(srcs[0], srcs[1], out=out)


@kernel("scale")
def _scale(out, srcs, attrs):
    np.multiply(srcs[0], out.dtype.type(attrs["s"]), out=out)


@kernel("silu")
def _silu(out, srcs, attrs):
    x = srcs[0]
    # x / (1 + exp(-x)): exp overflows to inf for x < -88 and the quotient is then the
    # correct limit -0, so the overflow warning is silenced rather than branched around.
    with np.errstate(over="ignore"):
        np.exp(-x, out=out)
    out += 1
    np.divide(x, out, out=out)


@kernel("silu_back")
def _silu_back(out, srcs, attrs):
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
def _gelu(out, srcs, attrs):
    x = srcs[0]
    np.multiply(x, 0.5 * (1 + _gelu_tanh(x)), out=out)


@kernel("gelu_back")
def _gelu_back(out, srcs, attrs):
    """d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), t = tanh(c (x + a x^3))."""
    x, g = srcs
    t = _gelu_tanh(x)
    c, a = x.dtype.type(_GELU_C), x.dtype.type(3 * _GELU_A)
    out[...] = g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + a * x * x))


@kernel("rms_norm")
def _rms_norm(out, srcs, attrs):
    x = srcs[0]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs["eps"])
    np.multiply(x, r, out=out)


@kernel("rms_norm_back")
def _rms_norm_back(out, srcs, attrs):
    x, g = srcs
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs["eps"])
    y = x * r
    out[...] = r * (g - y * np.mean(g * y, axis=-1, keepdims=True))


def rope_angles(positions, dims, base, dtype, freq_factors=None, freq_scale=1.0):
    """cos and sin of freq_scale * pos * base^(-2i/dims) / freq_factors[i], shaped
    [batch, seq, 1, dims/2] (ggml's rope angle with frequency factors and linear scaling)."""
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    theta = positions.astype(np.float64)[..., None] * inv_freq
    theta *= freq_scale  # exact at the default 1.0
    return np.cos(theta)[:, :, None, :].astype(dtype), np.sin(theta)[:, :, None, :].astype(dtype)


@kernel("rope")
def _rope(out, srcs, attrs):
    x, pos = srcs[:2]
    d = attrs["dims"]
    factors = srcs[2] if len(srcs) == 3 else None
    cos, sin = rope_angles(pos, d, attrs["base"], x.dtype, factors, attrs["freq_scale"])
    if attrs["inverse"]:
        sin = -sin
    if attrs["mode"] == "normal" and d == x.shape[-1] and x.flags.c_contiguous:
        # Adjacent pairs (x0, x1) are the complex number x0 + i x1, and rotating by theta
        # is one complex multiply: a third of the strided real arithmetic below.
        ctype = np.complex64 if x.dtype == np.float32 else np.complex128
        rot = (cos + 1j * sin).astype(ctype)
        np.multiply(x.view(ctype), rot, out=out.view(ctype))
        return
    if attrs["mode"] == "normal":
        x0, x1, o0, o1 = x[..., 0:d:2], x[..., 1:d:2], out[..., 0:d:2], out[..., 1:d:2]
    else:
        h = d // 2
        x0, x1, o0, o1 = x[..., :h], x[..., h:d], out[..., :h], out[..., h:d]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    o0[...], o1[...] = r0, r1
    out[..., d:] = x[..., d:]


def _causal_mask(t):
    return np.triu(np.ones((t, t), bool), k=1)


@kernel("softmax")
def _softmax(out, srcs, attrs):
    z = srcs[0] * out.dtype.type(attrs["scale"])
    if attrs["causal"]:
        z[..., _causal_mask(z.shape[-1])] = -np.inf
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    np.divide(z, z.sum(axis=-1, keepdims=True), out=out)


@kernel("softmax_back")
def _softmax_back(out, srcs, attrs):
    y, g = srcs
    out[...] = attrs["scale"] * y * (g - np.sum(g * y, axis=-1, keepdims=True))


# --- matmul ------------------------------------------------------------------------------------
@kernel("matmul")
def _matmul(out, srcs, attrs):
    a, b = srcs
    if attrs["trans_a"]:
        a = np.swapaxes(a, -1, -2)
    if attrs["trans_b"]:
        b = np.swapaxes(b, -1, -2)
    if b.ndim > 2:
        ab, bb = a.shape[:-2], (1,) * (a.ndim - b.ndim) + b.shape[:-2]
        if any(x != y and y != 1 and x != 1 for x, y in zip(ab, bb)):
            # Grouped-query: split each grouped axis of a into (kv_heads, group) and give b
            # a size-1 group axis, so plain broadcasting shares each K/V head.
            a_split, b_split = [], []
            for x, y in zip(ab, bb):
                if x != y and y != 1 and x != 1:
                    a_split += [y, x // y]
                    b_split += [y, 1]
                else:
                    a_split.append(x)
                    b_split.append(y)
            a = a.reshape(tuple(a_split) + a.shape[-2:])
            b = b.reshape(tuple(b_split) + b.shape[-2:])
            np.matmul(a, b, out=out.reshape(tuple(a_split) + out.shape[-2:]))
            return
    np.matmul(a, b, out=out)


# --- shape ops ---------------------------------------------------------------------------------
@kernel("reshape")
def _reshape(out, srcs, attrs):
    out[...] = srcs[0].reshape(out.shape)


@kernel("permute")
def _permute(out, srcs, attrs):
    out[...] = np.transpose(srcs[0], attrs["axes"])


@kernel("contiguous")
def _contiguous(out, srcs, attrs):
    out[...] = srcs[0]


@kernel("sum")
def _sum(out, srcs, attrs):
    out[...] = np.sum(srcs[0], axis=attrs["axis"])


# --- embedding and loss --------------------------------------------------------------------------
@kernel("get_rows")
def _get_rows(out, srcs, attrs):
    table, ids = srcs
    np.take(table, ids, axis=0, out=out)


@kernel("get_rows_back")
def _get_rows_back(out, srcs, attrs):
    g, ids = srcs
    out.fill(0)
    np.add.at(out, ids.reshape(-1), g.reshape(-1, g.shape[-1]))


_CE_ROWS = 64  # rows per chunk: keeps the exp temporaries in cache, not [N, vocab]


@kernel("cross_entropy")
def _cross_entropy(out, srcs, attrs):
    logits, labels = srcs
    valid = labels >= 0
    rows = np.nonzero(valid)[0]
    total = 0.0
    buf = np.empty((min(_CE_ROWS, max(len(rows), 1)), logits.shape[1]), logits.dtype)
    for start in range(0, len(rows), _CE_ROWS):
        r = rows[start:start + _CE_ROWS]
        z = buf[:len(r)]
        np.take(logits, r, axis=0, out=z)
        m = z.max(axis=1, keepdims=True)
        picked = z[np.arange(len(r)), labels[r]] - m[:, 0]
        z -= m
        np.exp(z, out=z)
        total += float(np.sum(np.log(z.sum(axis=1)) - picked, dtype=np.float64))
    n = len(rows)
    out[...] = total if attrs["reduction"] == "sum" else (total / n if n else 0.0)


@kernel("cross_entropy_back")
def _cross_entropy_back(out, srcs, attrs):
    logits, labels, g = srcs
    valid = labels >= 0
    n = int(valid.sum())
    m = logits.max(axis=-1, keepdims=True)
    np.subtract(logits, m, out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    rows = np.nonzero(valid)[0]
    out[rows, labels[rows]] -= 1.0
    w = g if attrs["reduction"] == "sum" else (g / n if n else 0.0 * g)
    out *= (valid[:, None] * w).astype(out.dtype)


@kernel("count_valid")
def _count_valid(out, srcs, attrs):
    out[...] = np.count_nonzero(srcs[0] >= 0)


# --- training side effects -----------------------------------------------------------------------
@kernel("accumulate")
def _accumulate(out, srcs, attrs):
    acc, value = srcs
    acc += value


@kernel("global_norm")
def _global_norm(out, srcs, attrs):
    *grads, divisor = srcs
    # Accumulate in float64 so the norm does not depend on how many tensors there are.
    sq = 0.0
    for g in grads:
        g64 = g.ravel().astype(np.float64)
        sq += float(np.dot(g64, g64))
    out[...] = np.sqrt(sq) / max(float(divisor), 1.0)


@kernel("adamw")
def _adamw(out, srcs, attrs):
    w, g, m, v, hp, norm, divisor = srcs
    lr, b1, b2, eps, wd, b1h, b2h = (w.dtype.type(h) for h in hp)
    coef = 1.0 / max(float(divisor), 1.0)
    max_norm = attrs["max_norm"]
    if max_norm > 0 and float(norm) > max_norm:
        coef *= max_norm / float(norm)
    gs = g * w.dtype.type(coef)
    m *= b1
    m += (1 - b1) * gs
    v *= b2
    v += (1 - b2) * gs * gs
    w *= 1 - lr * wd
    w -= lr * (m * b1h) / (np.sqrt(v * b2h) + eps)
