"""Helpers of the tensor-core attention tests (tests/cuda/test_cuda_tc_attention.py): bf16
rounding written from its definition, the f64 reference attention with every mask the op
supports (built as [T, T], small shapes only), and runs of the kernels on the host
executor with the operands laid out as tc_attention.cu expects."""
import numpy as np

from toygraph import ops  # noqa: F401
from toygraph.cuda.host.device import run_kernel
from toygraph.ops.lowering import constants, sources

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


def _swap_tokens(x, token_major):
    """[B, heads, T, d] <-> token-major [B, T, heads, d] when ``token_major`` (a contiguous
    copy either way): operands into the kernels' layout, their results back."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2) if token_major else x)


def _empty(shape, token_major):
    """A NaN-filled f32 output of logical ``shape`` [B, heads, T, d], in the layout."""
    B, n, T, d = shape
    return np.full((B, T, n, d) if token_major else shape, np.nan, np.float32)


def _operand_bits(x, HD, as_is):
    """An operand's bf16 bits as the kernels read them: the heads-first copy padded to HD,
    or (``as_is``: token-major, hd == HD) the token-major activation itself."""
    bits = padded_bits(x, HD)
    return _swap_tokens(bits, True) if as_is else bits


def run_forward(q, k, v, scale, causal=True, window=0, segs=None, sinks=None, source=None,
                token_major=False, as_is=False):
    """tg_tca_fwd_<HD> on the host: (o, lse) as float32, o [B, H, T, hd] whatever layout
    (``token_major``) the kernel wrote it in; ``as_is``: q, k, v handed over as token-major
    bf16 activations (asis = 7) instead of heads-first copies."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    HD = hd_bound(hd)
    assert not as_is or (token_major and hd == HD)
    out = _empty(q.shape, token_major)
    lse = np.full((B, H, T), np.nan, np.float32)
    qb, kb, vb = (_operand_bits(x, HD, as_is) for x in (q, k, v))
    args = [out, lse, qb, kb, vb, _or_null(segs, np.int32),
            _or_null(sinks, np.float32), np.int32(H), np.int32(KV), np.int32(T),
            np.int32(hd), np.float32(scale), np.int32(causal), np.int32(window),
            np.int32(token_major), np.int32(7 if as_is else 0)]
    run_kernel(f"tg_tca_fwd_{HD}", ((T + constants.TCA_BQ - 1) // constants.TCA_BQ, H, B),
               (constants.TCA_THREADS, 1, 1), args, source=source or tca_source())
    return _swap_tokens(out, token_major), lse


def run_backward(q, k, v, dout, scale, causal=True, window=0, segs=None, sinks=None,
                 source=None, token_major=False, as_is=False):
    """The tensor-core backward on the host, as the lowering chains it: the forward (o, L),
    tg_tca_bwd_prep (D, dO as bf16), tg_tca_bwd_dkdv, tg_tca_bwd_dq and, with sinks,
    tg_attn_bwd_sinks, with o, dO and the gradients in the layout ``token_major`` says.
    Returns (o, lse, dq, dk, dv, d sinks or None), float32, heads first. ``as_is``: q, k,
    v and dO handed over as token-major bf16 activations (asis = 15; the prep then only
    sums D, from dO's bf16 values)."""
    source = source or tca_source()
    B, H, T, hd = q.shape
    KV = k.shape[1]
    HD = hd_bound(hd)
    o, lse = run_forward(q, k, v, scale, causal, window, segs, sinks, source=source,
                         token_major=token_major, as_is=as_is)
    rows = B * H * T
    delta = np.full((B, H, T), np.nan, np.float32)
    tok = np.int32(token_major)
    if as_is:   # dO handed over in bf16: the prep reads its bits and writes no copy
        gb = _operand_bits(dout, HD, True)
        run_kernel("tg_tca_bwd_prep", (4, 1, 1), (64, 1, 1),
                   [NULL, delta, _swap_tokens(o, token_major), gb, np.int32(rows),
                    np.int32(hd), np.int32(HD), np.int32(H), np.int32(T), tok, np.int32(2)],
                   source=source)
    else:
        gb = np.zeros((B, H, T, HD), np.uint16)
        run_kernel("tg_tca_bwd_prep", (4, 1, 1), (64, 1, 1),
                   [gb, delta, _swap_tokens(o, token_major),
                    _swap_tokens(np.asarray(dout, np.float32), token_major), np.int32(rows),
                    np.int32(hd), np.int32(HD), np.int32(H), np.int32(T), tok, np.int32(0)],
                   source=source)
    qb, kb, vb = (_operand_bits(x, HD, as_is) for x in (q, k, v))
    common = [qb, kb, vb, gb, lse, delta, _or_null(segs, np.int32), np.int32(H), np.int32(KV),
              np.int32(T), np.int32(hd), np.float32(scale), np.int32(causal), np.int32(window),
              tok, np.int32(15 if as_is else 0)]
    dq = _empty(q.shape, token_major)
    dk, dv = _empty(k.shape, token_major), _empty(k.shape, token_major)
    tiles = (T + constants.TCA_BQ - 1) // constants.TCA_BQ
    block = (constants.TCA_THREADS, 1, 1)
    run_kernel(f"tg_tca_bwd_dkdv_{HD}", (tiles, KV, B), block, [dk, dv] + common, source=source)
    run_kernel(f"tg_tca_bwd_dq_{HD}", (tiles, H, B), block, [dq] + common, source=source)
    dsinks = None
    if sinks is not None:
        dsinks = np.full(H, np.nan, np.float32)
        run_kernel("tg_attn_bwd_sinks", (H, 1, 1), (constants.THREADS, 1, 1),
                   [dsinks, np.ascontiguousarray(sinks, np.float32), lse, delta, np.int32(B),
                    np.int32(H), np.int32(T)], source=source)
    dq, dk, dv = (_swap_tokens(x, token_major) for x in (dq, dk, dv))
    return o, lse, dq, dk, dv, dsinks


def backward_bounds(q, k, v, g, o_kernel, scale, causal=True, window=0, segs=None,
                    sinks=None):
    """The f64 reference gradients of the rounded operands and their error bounds, derived
    from where the kernels round (u = BF16_U):
    - D = rowsum(dO o) uses the f32 dO (the reference's is rounded) and the forward's o
      (``o_kernel``, checked against its own bound): |dD| <= u sum|dO||o| +
      sum|dO||o_kernel - o|;
    - dS = P (dP - D) scale, rounded to bf16 for the dq/dk mma: |d dS| <= u |dS| + P |dD| scale;
    - P is rounded to bf16 for dv = P^T dO: |d dv| <= u P^T |dO|;
    so |d dq| <= |d dS| |k|, |d dk| <= |d dS|^T |q|, |d dsinks| <= sum P_sink |dD|. Each
    bound gets a 1% margin and a floor of 2^-16 max|reference| for the f32 arithmetic."""
    qr, kr, vr, gr = (bf16_value(bf16_bits(x)).astype(np.float64) for x in (q, k, v, g))
    o, lse, (dq, dk, dv, dsinks) = reference(qr, kr, vr, scale, causal, window, segs, sinks,
                                             dout=gr)
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    kk = np.repeat(kr, G, axis=1)
    vis = visible(T, causal, window, segs)[:, None]
    p = np.where(vis, np.exp(scale * qr @ np.swapaxes(kk, -1, -2) - lse[..., None]), 0.0)
    g64 = np.asarray(g, np.float64)
    dD = (BF16_U * (np.abs(g64) * np.abs(o)).sum(-1)
          + (np.abs(g64) * np.abs(o_kernel - o)).sum(-1))              # [B, H, T]
    ds = p * (gr @ np.swapaxes(np.repeat(vr, G, 1), -1, -2) - (gr * o).sum(-1, keepdims=True))
    ds *= scale
    d_ds = BF16_U * np.abs(ds) + p * dD[..., None] * scale
    fold = lambda x: x.reshape(B, -1, G, T, hd).sum(2)  # noqa: E731
    bounds = [d_ds @ np.abs(kk),
              fold(np.swapaxes(d_ds, -1, -2) @ np.abs(qr)),
              fold(BF16_U * np.swapaxes(p, -1, -2) @ np.abs(gr))]
    refs = [dq, dk, dv]
    if sinks is not None:
        psink = np.exp(np.asarray(sinks, np.float64)[None, :, None] - lse)
        bounds.append((psink * dD).sum(axis=(0, 2)))
        refs.append(dsinks)
    bounds = [1.01 * bd + 2.0 ** -16 * np.abs(r).max() for bd, r in zip(bounds, refs)]
    return refs, bounds
