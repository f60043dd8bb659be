"""Helpers of the tensor-core attention tests (tests/test_ops_tc_attention*.py): bf16
rounding written from its definition, the f64 reference attention with every mask the op
supports (built as [T, T], small shapes only), and runs of the kernels on the host
executor with the operands laid out as tc_attention.cu expects."""
import numpy as np

from toygraph.core import ops  # noqa: F401  (the op families declare their kernel files)
from toygraph.cuda.host.device import run_kernel
from toygraph.cuda.lowering import constants, sources

#: bf16's unit roundoff: 8 significant bits, round to nearest.
BF16_U = 2.0 ** -8
TCA_FILES = ("flash_attention.cu", "tc_layout.cuh", "tc_matmul.cu", "tc_async.cuh",
             "tc_attention.cu")


def tca_source(extra: str = "") -> str:
    """The tensor-core attention kernels and what they need, one translation unit."""
    return extra + sources.module_source(TCA_FILES)


def bf16_bits(x):
    """f32 -> bf16 bits, round to nearest, ties to even (no NaN in these tests)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def padded_bits(x, HD):
    """[..., T, hd] f32 -> [..., T, HD] bf16 bits, zero columns past hd."""
    out = np.zeros(x.shape[:-1] + (HD,), np.uint16)
    out[..., :x.shape[-1]] = bf16_bits(x)
    return out


def visible(T, causal, window, segs=None):
    """[B or 1, T, T] bool: query i sees key j."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    vis = np.ones((T, T), bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= i - j < window
    vis = vis[None]
    if segs is not None:
        vis = vis & (segs[:, :, None] == segs[:, None, :])
    return vis


def reference(q, k, v, scale, causal=True, window=0, segs=None, sinks=None, dout=None):
    """f64 attention of (already rounded) q [B, H, T, hd], k, v [B, KV, T, hd]: o, the row
    log-sum-exp and, with ``dout``, (dq, dk, dv, d sinks)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = scale * q @ np.swapaxes(kk, -1, -2)
    vis = visible(T, causal, window, segs)[:, None]
    s = np.where(vis, s, -np.inf)
    top = s.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, np.float64)[None, :, None, None])
    e = np.exp(s - top)
    den = e.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - top)
    p = e / den
    o = p @ vv
    lse = (top + np.log(den))[..., 0]
    if dout is None:
        return o, lse
    g = np.asarray(dout, np.float64)
    delta = (g * o).sum(-1, keepdims=True)
    dvv = np.swapaxes(p, -1, -2) @ g
    ds = p * (g @ np.swapaxes(vv, -1, -2) - delta) * scale
    dq = ds @ kk
    dkk = np.swapaxes(ds, -1, -2) @ q
    fold = lambda x: x.reshape(B, -1, G, T, hd).sum(2)  # noqa: E731
    dsinks = None
    if sinks is not None:
        psink = np.exp(np.asarray(sinks, np.float64)[None, :, None] - lse)
        dsinks = -(psink * delta[..., 0]).sum(axis=(0, 2))
    return o, lse, (dq, fold(dkk), fold(dvv), dsinks)


#: A null pointer argument for run_kernel (a 64-bit zero passed by value).
NULL = np.uint64(0)


def _or_null(x, dtype):
    return NULL if x is None else np.ascontiguousarray(x, dtype)


def hd_bound(hd):
    return min(b for b in constants.TCA_HEAD_DIMS if hd <= b)


def run_forward(q, k, v, scale, causal=True, window=0, segs=None, sinks=None, source=None,
                stats_only=False):
    """tg_tca_fwd_<HD> on the host: (o, lse) as float32 (o None with ``stats_only``)."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    HD = hd_bound(hd)
    out = np.full((B, H, T, hd), np.nan, np.float32)
    lse = np.full((B, H, T), np.nan, np.float32)
    qb, kb, vb = (padded_bits(x, HD) for x in (q, k, v))
    args = [NULL if stats_only else out, lse, qb, kb, vb, _or_null(segs, np.int32),
            _or_null(sinks, np.float32), np.int32(H), np.int32(KV), np.int32(T),
            np.int32(hd), np.float32(scale), np.int32(causal), np.int32(window)]
    run_kernel(f"tg_tca_fwd_{HD}", ((T + constants.TCA_BQ - 1) // constants.TCA_BQ, H, B),
               (constants.TCA_THREADS, 1, 1), args, source=source or tca_source())
    return (None if stats_only else out), lse
