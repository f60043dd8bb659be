"""The numpy kernels of the flash_attention family (the reference backend; its ops and their rules
are in __init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.flash_attention import TOKEN_MAJOR, split_operands
from toygraph.ops.table import kernel

# Query rows per block: the scores of one block are [B, KV, group * rows, keys], never the
# whole [B, H, T, T]. The grouped query heads that share a K/V head are folded into the
# rows, so each block is one BLAS matmul per (batch, kv head).
ATTN_ROWS = 256


def _attn_blocks(q, k, attrs, segments=None, sinks=None):
    """Per query block [i0, i1): the visible keys [j0, j1) as a slice, the block's queries
    folded to [B, KV, G * rows, hd], its probabilities softmax(scale * q k^T)
    [B, KV, G * rows, j1 - j0], with ``sinks`` [H] each row's sink probability
    [1 or B, KV, G * rows, 1] (else None), and the rows' log-sum-exp L [B, KV, G * rows, 1]
    (q, k heads first). Query i sees key j iff j <= i (causal), i - j < window (when
    window > 0) and, with ``segments`` [B, T], segments[b, i] == segments[b, j], so keys
    past the block's last query and before its first query's window are never multiplied;
    other segments' keys are masked per block, never as a [T, T] array."""
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
        probs = np.matmul(qb, np.swapaxes(k[:, :, keys], -1, -2))
        probs *= probs.dtype.type(attrs["scale"])
        masked = np.zeros((1, rows, j1 - j0), bool)
        if attrs["causal"]:
            i, j = np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :]
            masked = masked | ((j > i) | (i - j >= window) if window else j > i)
        if segments is not None:
            masked = masked | (segments[:, i0:i1, None] != segments[:, None, keys])
        if masked.any():
            np.copyto(probs.reshape(B, KV, G, rows, j1 - j0), -np.inf,
                      where=masked[:, None, None])
        psink = None
        top = probs.max(axis=-1, keepdims=True)
        if sinks is not None:  # one more logit per row, sinks[h], with value 0
            sink = np.repeat(sinks.reshape(1, KV, G, 1), rows, axis=3).reshape(1, KV, G * rows, 1)
            top = np.maximum(top, sink)
        probs -= top
        np.exp(probs, out=probs)
        den = probs.sum(axis=-1, keepdims=True)
        if sinks is not None:
            psink = np.exp(sink - top)
            den = den + psink
            psink = psink / den
        probs /= den
        yield i0, i1, keys, qb, probs, psink, top + np.log(den)


def _fold(x5, i0, i1):
    """Rows [i0, i1) of a [B, KV, G, T, d] array as [B, KV, G * rows, d]."""
    B, KV, G, _, d = x5.shape
    return x5[:, :, :, i0:i1].reshape(B, KV, G * (i1 - i0), d)


def _heads(x, layout: str):
    """An operand or result in ``layout`` as [B, heads, T, d]: a view to write through."""
    return np.swapaxes(x, 1, 2) if layout == TOKEN_MAJOR else x


def _read(x, layout: str):
    """An operand as a contiguous [B, heads, T, d] array: a token-major one copied, so
    every product below sees the arrays a heads-first graph gives it (the same bits)."""
    return np.ascontiguousarray(_heads(x, layout))


def _unfold(x, B, H):
    """[B, KV, G * rows, d] (query rows folded per kv head) as [B, H, rows, d]."""
    return x.reshape(B, H, -1, x.shape[-1])


@kernel("attention")
def _attention_numpy(out, srcs, attrs):
    """o (in q's layout), then L [B, H, T] when the node saves it."""
    layout = attrs["layout"]
    q, k, v, seg, sinks, _ = split_operands(srcs, "attention", attrs)
    o = _heads(out[:q.size].reshape(q.shape), layout)
    q, k, v = (_read(x, layout) for x in (q, k, v))
    B, H, T, _ = q.shape
    lse = out[q.size:].reshape(B, H, T) if attrs["save_lse"] else None
    for i0, i1, keys, _, pr, _, lb in _attn_blocks(q, k, attrs, seg, sinks):
        o[:, :, i0:i1] = _unfold(np.matmul(pr, v[:, :, keys]), B, H)
        if lse is not None:
            lse[:, :, i0:i1] = _unfold(lb, B, H)[..., 0]


@kernel("attention_back")
def _attention_back_numpy(out, srcs, attrs):
    """[dq, dk, dv (, d sinks)] packed flat, from the recomputed probabilities block by
    block: dv = P^T dO, dS = P * (dO V^T - rowsum(dO * O)) * scale, dq = dS K, dk = dS^T Q,
    d sinks[h] = -sum of P_sink * rowsum(dO * O) over h's rows. The saved L is not read:
    the probabilities are made as the forward made them (exp(s - max) / sum), so numpy's
    gradients keep their bits; the CUDA kernels read L instead of a statistics pass."""
    layout = attrs["layout"]
    q, k, v, seg, sinks, (fwd, g) = split_operands(srcs, "attention_back", attrs)
    nq, nk = q.size, k.size
    dq = _heads(out[:nq].reshape(q.shape), layout)
    dk = _heads(out[nq:nq + nk].reshape(k.shape), layout)
    dv = _heads(out[nq + nk:nq + 2 * nk].reshape(k.shape), layout)
    dsinks = out[nq + 2 * nk:]   # [H] = [KV, G] with sinks, else empty
    out[nq:].fill(0)
    o = fwd[:nq].reshape(q.shape)
    q, k, v, g, o = (_read(x, layout) for x in (q, k, v, g, o))
    B, H, T, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    g5, o5 = g.reshape(B, KV, G, T, hd), o.reshape(B, KV, G, T, hd)
    scale = out.dtype.type(attrs["scale"])
    for i0, i1, keys, qb, pr, psink, _ in _attn_blocks(q, k, attrs, seg, sinks):
        gb = _fold(g5, i0, i1)
        delta = np.sum(gb * _fold(o5, i0, i1), axis=-1, keepdims=True)
        if psink is not None:
            dsinks -= (psink * delta).sum(axis=(0, 3)).reshape(KV, G, i1 - i0).sum(axis=2).ravel()
        dv[:, :, keys] += np.matmul(np.swapaxes(pr, -1, -2), gb)
        ds = np.matmul(gb, np.swapaxes(v[:, :, keys], -1, -2))
        ds -= delta
        ds *= pr
        ds *= scale
        dq[:, :, i0:i1] = _unfold(np.matmul(ds, k[:, :, keys]), B, H)
        dk[:, :, keys] += np.matmul(np.swapaxes(ds, -1, -2), qb)
