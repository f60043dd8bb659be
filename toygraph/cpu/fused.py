"""numpy kernels of the fused ops (ops_fused.py): attention over query blocks and the
output head + cross-entropy over row chunks, so neither builds a [T, T] or [N, vocab]
array. Registered in the same KERNELS table as kernels.py's."""
from __future__ import annotations

import numpy as np

from .registry import kernel


# --- fused attention ----------------------------------------------------------------------------
# Query rows per block: the scores of one block are [B, KV, group * rows, keys], never the
# whole [B, H, T, T]. The grouped query heads that share a K/V head are folded into the
# rows, so each block is one BLAS matmul per (batch, kv head).
ATTN_ROWS = 256


def _attn_blocks(q, k, attrs, segments=None):
    """Per query block [i0, i1): the visible keys [j0, j1) as a slice, the block's queries
    folded to [B, KV, G * rows, hd] and its probabilities softmax(scale * q k^T)
    [B, KV, G * rows, j1 - j0]. Query i sees key j iff j <= i (causal), i - j < window
    (when window > 0) and, with ``segments`` [B, T], segments[b, i] == segments[b, j], so
    keys past the block's last query and before its first query's window are never
    multiplied; other segments' keys are masked per block, never as a [T, T] array."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    window = attrs["window"]
    q5 = q.reshape(B, KV, G, T, hd)
    for i0 in range(0, T, ATTN_ROWS):
        i1 = min(i0 + ATTN_ROWS, T)
        rows = i1 - i0
        j1 = i1 if attrs["causal"] else T
        j0 = max(0, i0 - window + 1) if window else 0
        keys = slice(j0, j1)
        qb = q5[:, :, :, i0:i1].reshape(B, KV, G * rows, hd)
        p = np.matmul(qb, np.swapaxes(k[:, :, keys], -1, -2))
        p *= p.dtype.type(attrs["scale"])
        masked = np.zeros((1, rows, j1 - j0), bool)
        if attrs["causal"]:
            i, j = np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :]
            masked = masked | ((j > i) | (i - j >= window) if window else j > i)
        if segments is not None:
            masked = masked | (segments[:, i0:i1, None] != segments[:, None, keys])
        if masked.any():
            np.copyto(p.reshape(B, KV, G, rows, j1 - j0), -np.inf,
                      where=masked[:, None, None])
        p -= p.max(axis=-1, keepdims=True)
        np.exp(p, out=p)
        p /= p.sum(axis=-1, keepdims=True)
        yield i0, i1, keys, qb, p


def _fold(x5, i0, i1):
    """Rows [i0, i1) of a [B, KV, G, T, d] array as [B, KV, G * rows, d]."""
    B, KV, G, _, d = x5.shape
    return x5[:, :, :, i0:i1].reshape(B, KV, G * (i1 - i0), d)


@kernel("attention")
def _attention(out, srcs, attrs):
    q, k, v = srcs[:3]
    B, H, T, hd = q.shape
    KV = k.shape[1]
    out5 = out.reshape(B, KV, H // KV, T, hd)
    for i0, i1, keys, _, p in _attn_blocks(q, k, attrs, *srcs[3:]):
        out5[:, :, :, i0:i1] = np.matmul(p, v[:, :, keys]).reshape(B, KV, H // KV, i1 - i0, hd)


@kernel("attention_back")
def _attention_back(out, srcs, attrs):
    """[dq, dk, dv] packed flat, from the recomputed probabilities block by block:
    dv = P^T dO, dS = P * (dO V^T - rowsum(dO * O)) * scale, dq = dS K, dk = dS^T Q."""
    q, k, v, *segments, o, g = srcs    # segments: [] or [segment ids]
    B, H, T, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    nq, nk = q.size, k.size
    dq = out[:nq].reshape(B, KV, G, T, hd)
    dk = out[nq:nq + nk].reshape(k.shape)
    dv = out[nq + nk:].reshape(v.shape)
    dk.fill(0)
    dv.fill(0)
    g5, o5 = g.reshape(dq.shape), o.reshape(dq.shape)
    scale = out.dtype.type(attrs["scale"])
    for i0, i1, keys, qb, p in _attn_blocks(q, k, attrs, *segments):
        gb = _fold(g5, i0, i1)
        delta = np.sum(gb * _fold(o5, i0, i1), axis=-1, keepdims=True)
        dv[:, :, keys] += np.matmul(np.swapaxes(p, -1, -2), gb)
        ds = np.matmul(gb, np.swapaxes(v[:, :, keys], -1, -2))
        ds -= delta
        ds *= p
        ds *= scale
        dq[:, :, :, i0:i1] = np.matmul(ds, k[:, :, keys]).reshape(B, KV, G, i1 - i0, hd)
        dk[:, :, keys] += np.matmul(np.swapaxes(ds, -1, -2), qb)


@kernel("unpack")
def _unpack(out, srcs, attrs):
    off = attrs["offset"]
    out[...] = srcs[0].reshape(-1)[off:off + out.size].reshape(out.shape)


# --- fused output head + cross-entropy ---------------------------------------------------------
# Rows of the fused head + loss per chunk: a [rows, vocab] block of logits at a time (25 MB
# for SmolLM2's 49152-token vocabulary at 128 rows, f32) instead of [N, vocab]; fewer rows
# make the BLAS calls slower (SmolLM2 head, 512 rows: 0.73 s at 64, 0.63 s at 128).
LCE_ROWS = 128


def _lce_chunks(h, w, labels):
    """Per chunk of the rows whose label is not ignored: (row ids, h rows, exp(z - max) in
    a reused buffer, its row sums, the row max, the label's logit) with z = h_rows @ w^T."""
    rows = np.flatnonzero(labels >= 0)
    if not len(rows):
        return
    n = min(LCE_ROWS, len(rows))
    hbuf = np.empty((n, h.shape[1]), h.dtype)
    zbuf = np.empty((n, w.shape[0]), h.dtype)
    for start in range(0, len(rows), LCE_ROWS):
        r = rows[start:start + LCE_ROWS]
        c = len(r)
        hc, z = hbuf[:c], zbuf[:c]
        np.take(h, r, axis=0, out=hc)
        np.matmul(hc, w.T, out=z)
        m = z.max(axis=1, keepdims=True)
        picked = z[np.arange(c), labels[r]]
        z -= m
        np.exp(z, out=z)
        yield r, hc, z, z.sum(axis=1), m[:, 0], picked


@kernel("linear_cross_entropy")
def _linear_cross_entropy(out, srcs, attrs):
    h, w, labels = srcs
    total, n = 0.0, 0
    for r, _, _, s, m, picked in _lce_chunks(h, w, labels):
        total += float(np.sum(np.log(s) + m - picked, dtype=np.float64))
        n += len(r)
    out[...] = total if attrs["reduction"] == "sum" else (total / n if n else 0.0)


@kernel("linear_cross_entropy_back")
def _linear_cross_entropy_back(out, srcs, attrs):
    """[dh, dw] packed flat (each only when asked), chunk by chunk from the recomputed
    softmax: dz = (softmax(z) - onehot) * g (/ n for mean), dh = dz @ w, dw += dz^T h, the
    chunks added into dw in row order."""
    h, w, labels, g = srcs
    (N, D), V = h.shape, w.shape[0]
    dh = out[:N * D].reshape(N, D) if attrs["grad_h"] else None
    dw = out[N * D * attrs["grad_h"]:].reshape(V, D) if attrs["grad_w"] else None
    out.fill(0)
    n = int(np.count_nonzero(labels >= 0))
    scale = g if attrs["reduction"] == "sum" else (g / n if n else 0.0 * g)
    scale = out.dtype.type(scale)
    tmp = None
    for r, hc, z, s, _, _ in _lce_chunks(h, w, labels):
        z /= s[:, None]
        z[np.arange(len(r)), labels[r]] -= 1.0
        z *= scale
        if dh is not None:
            dh[r] = z @ w
        if dw is not None:
            if tmp is None:
                tmp = np.empty_like(dw)
            np.matmul(z.T, hc, out=tmp)
            dw += tmp
