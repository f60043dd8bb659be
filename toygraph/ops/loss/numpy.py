"""The numpy kernels of the loss family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.gemm.numpy import engine_multiplies
from toygraph.ops.table import block_kernel, kernel

_CE_ROWS = 64  # rows per chunk: keeps the exp temporaries in cache, not [N, vocab]


@kernel("cross_entropy")
def _cross_entropy_numpy(out, srcs, attrs):
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
def _cross_entropy_back_numpy(out, srcs, attrs):
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
def _count_valid_numpy(out, srcs, attrs):
    out[...] = np.count_nonzero(srcs[0] >= 0)


# Rows of the fused head + loss per chunk: a [rows, vocab] block of logits at a time (25 MB
# for SmolLM2's 49152-token vocabulary at 128 rows, f32) instead of [N, vocab]; fewer rows
# make the BLAS calls slower (SmolLM2 head, 512 rows: 0.73 s at 64, 0.63 s at 128).
LCE_ROWS = 128


def _head_rows(hc, w, z):
    """z = hc @ w^T: BLAS on an f32 head, the CPU engine on one kept in its blocks (a
    cpu.block_tensor.BlockTensor: each chunk's product decodes the head panel by panel)."""
    if isinstance(w, np.ndarray):
        np.matmul(hc, w.T, out=z)
    else:
        w.matmul_nt(hc, z)


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
        _head_rows(hc, w, z)
        m = z.max(axis=1, keepdims=True)
        picked = z[np.arange(c), labels[r]]
        z -= m
        np.exp(z, out=z)
        yield r, hc, z, z.sum(axis=1), m[:, 0], picked


@block_kernel("linear_cross_entropy", reads=(1,), when=lambda node, itemsize: engine_multiplies(
    node.srcs[1], itemsize))
@kernel("linear_cross_entropy")
def _linear_cross_entropy_numpy(out, srcs, attrs, scratch=None):
    h, w, labels = srcs
    total, n = 0.0, 0
    if attrs["reduction"] == "none":
        out.fill(0)
    for r, _, _, s, m, picked in _lce_chunks(h, w, labels):
        row_loss = np.log(s) + m - picked
        if attrs["reduction"] == "none":
            out[r] = row_loss
        total += float(np.sum(row_loss, dtype=np.float64))
        n += len(r)
    if attrs["reduction"] != "none":
        out[...] = total if attrs["reduction"] == "sum" else (total / n if n else 0.0)


@block_kernel("linear_cross_entropy_back", reads=(1,),
              when=lambda node, itemsize: not node.attrs["grad_w"] and engine_multiplies(
                  node.srcs[1], itemsize))
@kernel("linear_cross_entropy_back")
def _linear_cross_entropy_back_numpy(out, srcs, attrs, scratch=None):
    """[dh, dw] packed flat (each only when asked), chunk by chunk from the recomputed
    softmax: dz = (softmax(z) - onehot) * g (/ n for mean), dh = dz @ w, dw += dz^T h, the
    chunks added into dw in row order. For ``none`` the weight is g's entry of each row.
    A frozen head kept in its blocks (the block kernel: no dw) is read by the CPU engine."""
    h, w, labels, g = srcs
    (N, D), V = h.shape, w.shape[0]
    dh = out[:N * D].reshape(N, D) if attrs["grad_h"] else None
    dw = out[N * D * attrs["grad_h"]:].reshape(V, D) if attrs["grad_w"] else None
    out.fill(0)
    n = int(np.count_nonzero(labels >= 0))
    per_row = attrs["reduction"] == "none"
    scale = g if attrs["reduction"] != "mean" else (g / n if n else 0.0 * g)
    scale = scale.astype(out.dtype) if per_row else out.dtype.type(scale)
    tmp = None
    for r, hc, z, s, _, _ in _lce_chunks(h, w, labels):
        z /= s[:, None]
        z[np.arange(len(r)), labels[r]] -= 1.0
        z *= scale[r, None] if per_row else scale
        if dh is not None:
            dh[r] = z @ w if isinstance(w, np.ndarray) else w.matmul_nn(z, np.empty((len(r), D), z.dtype))
        if dw is not None:
            if tmp is None:
                tmp = np.empty_like(dw)
            np.matmul(z.T, hc, out=tmp)
            dw += tmp
