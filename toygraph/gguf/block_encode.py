"""Simple encoders for the GGML block formats, for writing fixtures and tests.

Not used on the training path (toygraph only ever decodes). Types ``gguf.quants`` can
encode are delegated to it; for the others (the K-quants and IQ4 formats, which gguf-py
0.19 can only decode) a plain min/max or abs-max quantizer is used: valid blocks that
every decoder reads the same way, but not llama.cpp's error-optimal search. The byte
layouts are those documented in :mod:`toygraph.gguf.blocks`.

>>> import numpy as np
>>> encode(np.zeros((1, 256), np.float32), "q3_k").shape
(1, 110)
"""
from __future__ import annotations

import numpy as np

from toygraph.gguf.blocks import GGML_TYPE, IQ4NL_VALUES, QK_K, block_shape

GGUF_ENCODES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")
_LEVELS = np.array(IQ4NL_VALUES, np.float32)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], np.uint8)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _f16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to f16 and back: the scale a decoder will actually see."""
    return x.astype(np.float16).astype(np.float32)


def _asym_scales(sub: np.ndarray, top: int, smax: int):
    """Per-sub-block scale and min for ``q * (d*sc) - dmin*mn`` with q in [0, top] and
    sc, mn in [0, smax]: returns (d, dmin, sc, mn, q), d and dmin f16-rounded."""
    lo = np.minimum(sub.min(axis=2), 0.0)        # ggml's mins are <= 0 (stored negated)
    scale = (sub.max(axis=2) - lo) / top
    d16, dmin16 = _f16(scale.max(axis=1) / smax), _f16((-lo).max(axis=1) / smax)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(0, smax)
        mn = np.where(dmin16[:, None] > 0, np.rint(-lo / dmin16[:, None]), 0).clip(0, smax)
        eff_d = (d16[:, None] * sc)[:, :, None]
        eff_m = (dmin16[:, None] * mn)[:, :, None]
        q = np.where(eff_d > 0, np.rint((sub + eff_m) / eff_d), 0).clip(0, top).astype(np.uint8)
    return d16, dmin16, sc.astype(np.uint8), mn.astype(np.uint8), q


def _sym_scales(sub: np.ndarray, qmin: int, smax: int):
    """Signed per-sub-block scales for ``(d*sc) * q``: the value of largest magnitude maps
    to ``qmin``; sc in [-smax-1, smax]. Returns (d (f16-rounded), sc, d*sc per sub-block)."""
    amax_i = np.abs(sub).argmax(axis=2)
    scale = np.take_along_axis(sub, amax_i[:, :, None], axis=2)[:, :, 0] / qmin
    d16 = _f16(np.abs(scale).max(axis=1) / smax)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(-smax - 1, smax)
    return d16, sc, (d16[:, None] * sc)[:, :, None]


def _levels(sub: np.ndarray, eff: np.ndarray, lo: int, hi: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(eff != 0, np.rint(sub / eff), 0).clip(lo, hi)


def _nearest_iq4(sub: np.ndarray, eff: np.ndarray) -> np.ndarray:
    """Index of the IQ4_NL level nearest to each ``sub / eff``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(eff != 0, sub / eff, 0)
    return np.abs(v[..., None] - _LEVELS).argmin(axis=-1).astype(np.uint8)


def _pack_nibbles32(q: np.ndarray) -> np.ndarray:
    """Runs of 32 4-bit values -> 16 bytes each: element i < 16 low nibble of byte i."""
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """(n, 256) 2-bit values -> (n, 64) bytes: element 128h + 32s + l at bits 2s of 32h + l."""
    shifted = q.reshape(-1, 2, 4, 32) << _CRUMB_SHIFTS.reshape(1, 1, 4, 1)
    return shifted.sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of blocks.unpack_k_scales: (n, 8) 6-bit scales and mins -> (n, 12) bytes."""
    lo = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _quantize_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: 8 sub-blocks of 32, 6-bit scales and mins."""
    n = x.shape[0]
    d16, dmin16, sc, mn, q = _asym_scales(x.reshape(n, 8, 32), (1 << bits) - 1, 63)
    ql = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (ql[:, :, 0] | (ql[:, :, 1] << 4)).reshape(n, 128)
    parts = [_f16_bytes(d16), _f16_bytes(dmin16), _pack_k_scales(sc, mn)]
    if bits == 5:
        hbit = (q >> 4).astype(np.uint8)                              # (n, 8, 32)
        qh = (hbit << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
        parts.append(qh)
    return np.concatenate(parts + [qs], axis=1)


def _quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16, 4-bit scales and mins packed in one byte each."""
    n = x.shape[0]
    d16, dmin16, sc, mn, q = _asym_scales(x.reshape(n, 16, 16), 3, 15)
    return np.concatenate([sc | (mn << 4), _pack_crumbs(q.reshape(n, QK_K)),
                           _f16_bytes(d16), _f16_bytes(dmin16)], axis=1)


def _quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K: q in [-4, 3] as 2 low bits (qs) + a "not negative" bit (hmask), 6-bit scales."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    d16, sc, eff = _sym_scales(sub, -4, 31)
    q = _levels(sub, eff, -4, 3).astype(np.int8).reshape(n, QK_K)
    hbit = (q >= 0).astype(np.uint8).reshape(n, 8, 32)
    hmask = (hbit << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    u = (sc + 32).astype(np.uint8)                                      # (n, 16), 6 bits
    low = (u[:, :8] & 0x0F) | ((u[:, 8:] & 0x0F) << 4)
    high = ((u >> 4).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1))
    scales = np.concatenate([low, high.sum(axis=1, dtype=np.uint8)], axis=1)
    return np.concatenate([hmask, _pack_crumbs(q.view(np.uint8) & 3), scales,
                           _f16_bytes(d16)], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    d16, sc, eff = _sym_scales(sub, -32, 127)
    q = (_levels(sub, eff, -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)            # half, quarter (l, l+32, l+64, l+96), l
    ql = np.concatenate([q[:, :, 0] & 0x0F | (q[:, :, 2] & 0x0F) << 4,
                         q[:, :, 1] & 0x0F | (q[:, :, 3] & 0x0F) << 4], axis=2).reshape(n, 128)
    qh = ((q >> 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d16)], axis=1)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL: one f16 scale per 32, each element the nearest of the 16 levels."""
    sub = x.reshape(-1, 1, 32)
    amax_i = np.abs(sub).argmax(axis=2)
    d16 = _f16(np.take_along_axis(sub, amax_i[:, :, None], axis=2)[:, 0, 0] / IQ4NL_VALUES[0])
    q = _nearest_iq4(sub, d16.reshape(-1, 1, 1)).reshape(-1, 32)
    return np.concatenate([_f16_bytes(d16), _pack_nibbles32(q)], axis=1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS: 8 sub-blocks of 32 with 6-bit signed scales, levels as IQ4_NL."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    d16, ls, eff = _sym_scales(sub, IQ4NL_VALUES[0], 31)
    qs = _pack_nibbles32(_nearest_iq4(sub, eff)).reshape(n, 128)
    u = (ls + 32).astype(np.uint8)                                      # (n, 8), 6 bits
    scales_l = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
    scales_h = ((u >> 4).astype(np.uint16) << np.arange(0, 16, 2, dtype=np.uint16)).sum(
        axis=1, dtype=np.uint16)
    return np.concatenate([_f16_bytes(d16), scales_h.reshape(n, 1).view(np.uint8), scales_l,
                           qs], axis=1)


_ENCODERS = {
    "q2_k": _quantize_q2_k, "q3_k": _quantize_q3_k,
    "q4_k": lambda x: _quantize_k(x, 4), "q5_k": lambda x: _quantize_k(x, 5),
    "q6_k": _quantize_q6_k, "iq4_xs": _quantize_iq4_xs,
}


def quantize(arr: np.ndarray, qtype: str) -> np.ndarray:
    """Encode ``arr`` (last dim a multiple of the block size) as ``qtype`` block bytes.

    Returns a uint8 array of shape ``(*arr.shape[:-1], bytes_per_row)``, the form
    ``gguf.GGUFWriter.add_tensor(..., raw_dtype=...)`` expects. For writing fixtures,
    tests and merged exports, not used on the training path.
    """
    arr = np.asarray(arr, dtype=np.float32)
    block_shape(qtype, arr.shape)
    return encode(arr, qtype)


def encode(arr: np.ndarray, qtype: str) -> np.ndarray:
    """``arr`` (float32, last dim a whole number of blocks) as ``qtype`` block bytes of
    shape ``(*arr.shape[:-1], bytes_per_row)`` (see :func:`quantize`, which checks shapes)."""
    if qtype in GGUF_ENCODES:
        import gguf.quants
        out = gguf.quants.quantize(arr, GGML_TYPE[qtype])
        return np.ascontiguousarray(out).view(np.uint8).reshape(*arr.shape[:-1], -1)
    if qtype == "iq4_nl":
        enc = _quantize_iq4_nl(arr.reshape(-1, 32))
    else:
        enc = _ENCODERS[qtype](arr.reshape(-1, QK_K))
    return enc.reshape(*arr.shape[:-1], -1)
