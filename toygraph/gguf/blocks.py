"""GGML block formats: sizes, byte layouts, and vectorized numpy dequantizers.

A quantized tensor is stored row by row along its contiguous dimension (ggml ``ne0``,
the *last* numpy dimension); each row is a run of fixed-size blocks. The layout
constants below are the single description of those blocks that the numpy code here
and the CUDA kernels share, so a kernel never hard-codes an offset of its own.

Dequantization follows ggml's arithmetic order exactly (e.g. Q4_K is
``(d*sc)*q - (dmin*m)`` in f32) so that our results are bit-identical to ggml's and to
``gguf.quants.dequantize``; a CUDA kernel that wants the same bits must keep that order.

>>> import numpy as np
>>> raw = np.zeros((2, 34), np.uint8)        # two q8_0 rows of one block: zero scale and values
>>> dequantize(raw, "q8_0", (2, 32)).shape
(2, 32)

Encoding (for fixtures, tests and merged export) is block_encode.py's.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as _T

from toygraph.errors import GGUFError

QK_K = 256  # super-block size of the K-quants

# name -> (elements per block, bytes per block). A new format goes at the end: the C tables
# that expand TG_BLOCK_FORMATS (BLOCK_FORMATS below) keep this order, and the CPU engine's
# fused-kernel tables (cpu/dot.h, dot8.h) are positional, so a format appended there takes
# the decoded-row path until it gets a kernel.
BLOCK: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
    "q2_k": (QK_K, 84),
    "q3_k": (QK_K, 110),
    "q4_k": (QK_K, 144),
    "q5_k": (QK_K, 176),
    "q6_k": (QK_K, 210),
    "iq4_xs": (QK_K, 136),
    "mxfp4": (32, 17),
}

GGML_TYPE: dict[str, _T] = {
    "f32": _T.F32, "f16": _T.F16, "bf16": _T.BF16,
    "q8_0": _T.Q8_0, "q4_0": _T.Q4_0, "q4_1": _T.Q4_1,
    "q5_0": _T.Q5_0, "q5_1": _T.Q5_1, "iq4_nl": _T.IQ4_NL,
    "q2_k": _T.Q2_K, "q3_k": _T.Q3_K, "q4_k": _T.Q4_K, "q5_k": _T.Q5_K, "q6_k": _T.Q6_K,
    "iq4_xs": _T.IQ4_XS, "mxfp4": _T.MXFP4,
}
_NAME_OF = {v: k for k, v in GGML_TYPE.items()}

#: Every format a kernel decodes (all but f32, which is used as it is), in BLOCK's order:
#: the one list the C and CUDA tables expand (``TG_BLOCK_FORMATS`` in :func:`c_defines`),
#: and the CPU engine's formats.
BLOCK_FORMATS: tuple[str, ...] = tuple(f for f in BLOCK if f != "f32")

# Byte offsets inside one block (all little-endian; d/dmin/m are f16).
#   q8_0: d | qs int8[32]                      x[i] = qs[i] * d
#   q4_0: d | qs[16]                           x[i] = (nib(i) - 8) * d,   nib(i): i<16 low
#                                              nibble of qs[i], else high nibble of qs[i-16]
#   q4_1: d | m | qs[16]                       x[i] = nib(i) * d + m  (same nibbles as q4_0)
#   q5_0: d | qh[4] | qs[16]                   x[i] = (q(i) - 16) * d, q(i) = nib(i) | bit i
#                                              of qh (a little-endian u32) << 4
#   q5_1: d | m | qh[4] | qs[16]               x[i] = q(i) * d + m   (q(i) as q5_0)
#   iq4_nl: d | qs[16]                         x[i] = d * IQ4NL_VALUES[nib(i)]
#   q2_k: scales[16] | qs[64] | d | dmin       16 sub-blocks of 16; element e in half
#         h = e//128, r = e%128: q = (qs[32h + r%32] >> 2*(r//32)) & 3 (as q6_k's ql
#         crumbs); x = (d*(sc[e//16] & 15))*q - dmin*(sc[e//16] >> 4)
#   q3_k: hmask[32] | qs[64] | scales[12] | d  q = crumb(e) (as q2_k) - 4 unless bit
#         e//32 of hmask[e%32] is set; 16 6-bit scales s: low 4 bits from nibble j//8
#         of byte j%8, high 2 from bits 2*(j//4) of byte 8 + j%4; x = (d*(s - 32))*q
#   iq4_xs: d | scales_h u16 | scales_l[4] | qs[128]   8 sub-blocks of 32, each packed
#         like an iq4_nl block; 6-bit ls[j] = nibble j%2 of scales_l[j//2] | bits 2j of
#         scales_h << 4; x = (d*(ls - 32)) * IQ4NL_VALUES[nib]
#   q4_k: d | dmin | scales[12] | qs[128]      8 sub-blocks of 32; sub-block j uses the
#         32 bytes qs[32*(j//2):][:32], low nibbles for even j, high for odd j;
#         x = (d*sc[j]) * q - (dmin*m[j]), 6-bit sc/m packed as in unpack_k_scales()
#   q5_k: d | dmin | scales[12] | qh[32] | qs[128]   as q4_k plus bit 4 of element l of
#         sub-block j = (qh[l] >> j) & 1
#   q6_k: ql[128] | qh[64] | scales int8[16] | d   two halves of 128 elements; half h,
#         l in 0..31: el l    = ql[64h+l] low  | ((qh[32h+l] >> 0) & 3) << 4
#                     el l+32 = ql[64h+l+32] low | ((qh[32h+l] >> 2) & 3) << 4
#                     el l+64 = ql[64h+l] high | ((qh[32h+l] >> 4) & 3) << 4
#                     el l+96 = ql[64h+l+32] high | ((qh[32h+l] >> 6) & 3) << 4
#         x = (d*scales[e//16]) * (q - 32)
#   mxfp4: e | qs[16]                          x[i] = E8M0_HALF(e) * MXFP4_VALUES[nib(i)]
#         (OCP microscaling: e an 8-bit power-of-two exponent, E8M0_HALF(e) = 2^(e-128)
#         as ggml_e8m0_to_fp32_half builds it; the 16 e2m1 levels doubled)
LAYOUT: dict[str, dict[str, int]] = {
    "q8_0": {"d": 0, "qs": 2},
    "q4_0": {"d": 0, "qs": 2},
    "q4_1": {"d": 0, "m": 2, "qs": 4},
    "q5_0": {"d": 0, "qh": 2, "qs": 6},
    "q5_1": {"d": 0, "m": 2, "qh": 4, "qs": 8},
    "iq4_nl": {"d": 0, "qs": 2},
    "q2_k": {"scales": 0, "qs": 16, "d": 80, "dmin": 82},
    "q3_k": {"hmask": 0, "qs": 32, "scales": 96, "d": 108},
    "q4_k": {"d": 0, "dmin": 2, "scales": 4, "qs": 16},
    "q5_k": {"d": 0, "dmin": 2, "scales": 4, "qh": 16, "qs": 48},
    "q6_k": {"ql": 0, "qh": 128, "scales": 192, "d": 208},
    "iq4_xs": {"d": 0, "scales_h": 2, "scales_l": 4, "qs": 8},
    "mxfp4": {"e": 0, "qs": 1},
}

#: The 16 non-linear levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl). The CUDA
#: decoders get them from here too (:func:`c_defines`).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4NL = np.array(IQ4NL_VALUES, np.float32)

#: MXFP4's 16 e2m1 levels, doubled (ggml's kvalues_mxfp4; the CUDA decoder's table too).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_MXFP4 = np.array(MXFP4_VALUES, np.float32)


def c_formats() -> tuple[tuple[str, str], ...]:
    """(name, C name) of each of BLOCK_FORMATS, ``("q4_k", "Q4_K")``: the arguments
    ``TG_BLOCK_FORMATS(X)`` passes to ``X``, from which the tables name each format's
    decoders: ``TgQ4_K`` in ops/include/blocks.cuh, ``q4_k`` in cpu/decode.h."""
    return tuple((fmt, fmt.upper()) for fmt in BLOCK_FORMATS)


def c_defines() -> str:
    """BLOCK, LAYOUT, IQ4NL_VALUES and MXFP4_VALUES as C macros (``TG_Q4_K_QK``,
    ``TG_Q4_K_BYTES``, ``TG_Q4_K_SCALES``..., ``TG_IQ4NL_VALUES``, ``TG_MXFP4_VALUES``) for
    every stored format but f32: the one description of each block that the C and CUDA
    decoders compile against. And BLOCK_FORMATS as an X-macro, ``TG_BLOCK_FORMATS(X)``:
    ``X(f16, F16) X(bf16, BF16) X(q8_0, Q8_0) ...``, which every per-format table (the
    CUDA kernels, the CPU engine's decoders) expands, so none lists the formats itself."""
    xs = " ".join(f"X({fmt}, {name})" for fmt, name in c_formats())
    lines = ["// generated from toygraph.gguf.blocks BLOCK, LAYOUT, IQ4NL_VALUES, MXFP4_VALUES",
             f"#define TG_IQ4NL_VALUES {', '.join(map(str, IQ4NL_VALUES))}",
             f"#define TG_MXFP4_VALUES {', '.join(map(str, MXFP4_VALUES))}",
             f"#define TG_BLOCK_FORMATS(X) {xs}"]
    for fmt in BLOCK_FORMATS:
        elems, size = BLOCK[fmt]
        name = fmt.upper()
        lines += [f"#define TG_{name}_QK {elems}", f"#define TG_{name}_BYTES {size}"]
        lines += [f"#define TG_{name}_{field.upper()} {off}"
                  for field, off in LAYOUT.get(fmt, {}).items()]
    return "\n".join(lines) + "\n"


# Dequantize at most this many blocks at a time, so temporaries stay small even for
# a 49152 x 576 embedding.
_CHUNK_BLOCKS = 1 << 16


def qtype_name(ggml_type) -> str:
    """The toygraph name ("q4_k", ...) of a ``gguf.GGMLQuantizationType`` (or its int)."""
    try:
        return _NAME_OF[_T(int(ggml_type))]
    except (KeyError, ValueError):
        name = getattr(ggml_type, "name", ggml_type)
        raise GGUFError(f"unsupported tensor type {name} (supported: {', '.join(BLOCK)})") from None


def block_shape(qtype: str, shape) -> tuple[int, int]:
    """(elements, bytes) of one ``qtype`` block, after checking that ``shape``'s rows are
    whole blocks."""
    if qtype not in BLOCK:
        raise GGUFError(f"unknown quantization type {qtype!r} (supported: {', '.join(BLOCK)})")
    shape = tuple(int(s) for s in shape)
    elems, nbytes_ = BLOCK[qtype]
    if not shape or shape[-1] % elems:
        raise GGUFError(f"{qtype}: row length of shape {shape} must be a multiple of {elems}")
    return elems, nbytes_


def nbytes(qtype: str, shape) -> int:
    """Bytes a tensor of numpy ``shape`` takes in block format ``qtype``."""
    elems, size = block_shape(qtype, shape)
    return math.prod(int(s) for s in shape) // elems * size


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """The f16 field at byte ``off`` of every block, as an (n, 1) f32 column."""
    return blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return qs & np.uint8(0x0F), qs >> np.uint8(4)


def unpack_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K scale field into 8 scales and 8 mins (6 bits each).

    Sub-blocks 0..3 use the low 6 bits of bytes 0..3 (scale) and 4..7 (min); sub-blocks
    4..7 take their low 4 bits from bytes 8..11 and their top 2 bits from the spare top
    bits of bytes 0..3 (scale) and 4..7 (min).
    """
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _deq_q8_0(b):
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b, 0)


def _q4_values(qs):
    lo, hi = _nibbles(qs)
    return np.concatenate([lo, hi], axis=1)


def _deq_q4_0(b):
    return _f16(b, 0) * (_q4_values(b[:, 2:]).astype(np.float32) - 8.0)


def _deq_q4_1(b):
    return _f16(b, 0) * _q4_values(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q5_values(b, qh_off, qs_off):
    """Q5_0/Q5_1's 32 five-bit values: the Q4 nibbles plus bit i of the u32 qh."""
    hbit = np.unpackbits(b[:, qh_off:qh_off + 4], axis=1, bitorder="little")
    return _q4_values(b[:, qs_off:qs_off + 16]) | (hbit << np.uint8(4))


def _deq_q5_0(b):
    lay = LAYOUT["q5_0"]
    q = _q5_values(b, lay["qh"], lay["qs"]).astype(np.float32)
    return _f16(b, lay["d"]) * (q - 16.0)


def _deq_q5_1(b):
    lay = LAYOUT["q5_1"]
    q = _q5_values(b, lay["qh"], lay["qs"]).astype(np.float32)
    return _f16(b, lay["d"]) * q + _f16(b, lay["m"])


def _deq_iq4_nl(b):
    lay = LAYOUT["iq4_nl"]
    return _f16(b, lay["d"]) * _IQ4NL[_q4_values(b[:, lay["qs"]:lay["qs"] + 16])]


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 256 two-bit values from their 64 qs bytes, as (n, 16, 16) sub-blocks."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & np.uint8(3)).reshape(n, 16, 16)


def _deq_q2_k(b):
    lay, n = LAYOUT["q2_k"], b.shape[0]
    sc = b[:, lay["scales"]:lay["scales"] + 16]
    dl = (_f16(b, lay["d"]) * (sc & np.uint8(15)).astype(np.float32))[:, :, None]
    ml = (_f16(b, lay["dmin"]) * (sc >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, lay["qs"]:lay["qs"] + 64]).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b):
    lay, n = LAYOUT["q3_k"], b.shape[0]
    raw = b[:, lay["scales"]:lay["scales"] + 12]
    low = np.concatenate(_nibbles(raw[:, :8]), axis=1)
    high = (raw[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1))
    sc = (low | ((high.reshape(n, 16) & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (_f16(b, lay["d"]) * sc.astype(np.float32))[:, :, None]
    hmask = b[:, lay["hmask"]:lay["hmask"] + 32].reshape(n, 1, 32)
    hbit = ((hmask >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)).reshape(n, 16, 16)
    q = _crumbs(b[:, lay["qs"]:lay["qs"] + 64]).astype(np.int8) - ((hbit ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return (dl * q.astype(np.float32)).reshape(n, QK_K)


def _deq_iq4_xs(b):
    lay, n = LAYOUT["iq4_xs"], b.shape[0]
    lo = np.stack(_nibbles(b[:, lay["scales_l"]:lay["scales_l"] + 4]), axis=2).reshape(n, 8)
    sh = b[:, lay["scales_h"]:lay["scales_h"] + 2].copy().view(np.uint16)      # (n, 1)
    hi = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)).astype(np.uint8)
    ls = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (_f16(b, lay["d"]) * ls.astype(np.float32))[:, :, None]
    q = _q4_values(b[:, lay["qs"]:lay["qs"] + 128].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * _IQ4NL[q]).reshape(n, QK_K)


def _k_quants(b, qs_off, qh_off=None):
    """Shared Q4_K/Q5_K body: (d*sc)*q - dmin*m over 8 sub-blocks of 32."""
    n = b.shape[0]
    sc, mn = unpack_k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc)[:, :, None]
    dm = (_f16(b, 2) * mn)[:, :, None]
    lo, hi = _nibbles(b[:, qs_off:qs_off + 128].reshape(n, 4, 1, 32))
    q = np.concatenate([lo, hi], axis=2).reshape(n, 8, 32)  # sub-block 2c: low, 2c+1: high
    if qh_off is not None:
        qh = b[:, qh_off:qh_off + 32].reshape(n, 1, 32)
        bit = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
        q = q | (bit << np.uint8(4))
    return (d * q.astype(np.float32) - dm).reshape(n, QK_K)


def _deq_q4_k(b):
    return _k_quants(b, 16)


def _deq_q5_k(b):
    return _k_quants(b, 48, qh_off=16)


def _deq_q6_k(b):
    n = b.shape[0]
    lo, hi = _nibbles(b[:, 0:128].reshape(n, 2, 1, 64))
    ql = np.concatenate([lo, hi], axis=2).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & np.uint8(3)) << np.uint8(4))).reshape(n, 16, 16).astype(np.float32)
    d = (_f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]
    return (d * (q - 32.0)).reshape(n, QK_K)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as f32 bits, ggml_e8m0_to_fp32_half's way (denormals for e < 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _deq_mxfp4(b):
    lay = LAYOUT["mxfp4"]
    d = e8m0_half(b[:, lay["e"]]).reshape(-1, 1)
    return d * _MXFP4[_q4_values(b[:, lay["qs"]:lay["qs"] + 16])]


_DEQUANT = {
    "q8_0": _deq_q8_0, "q4_0": _deq_q4_0, "q4_1": _deq_q4_1,
    "q5_0": _deq_q5_0, "q5_1": _deq_q5_1, "iq4_nl": _deq_iq4_nl,
    "q2_k": _deq_q2_k, "q3_k": _deq_q3_k, "q4_k": _deq_q4_k, "q5_k": _deq_q5_k,
    "q6_k": _deq_q6_k, "iq4_xs": _deq_iq4_xs, "mxfp4": _deq_mxfp4,
}


def as_bytes(raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw)
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)
    return raw.reshape(-1).view(np.uint8)


def dequantize(raw: np.ndarray, qtype: str, shape) -> np.ndarray:
    """Decode ``raw`` block bytes (uint8, may be a memmap) into a float32 array of ``shape``.

    ``shape`` is in numpy order (last dim = contiguous ggml ne0). For f32/f16/bf16,
    ``raw`` may also be an already typed array.

    >>> import numpy as np
    >>> dequantize(np.array([1.5, 2], np.float16), "f16", (2,))
    array([1.5, 2. ], dtype=float32)
    """
    elems, size = block_shape(qtype, shape)
    shape = tuple(int(s) for s in shape)
    data = as_bytes(raw)
    want = nbytes(qtype, shape)
    if data.size != want:
        raise GGUFError(f"{qtype} tensor of shape {shape} needs {want} bytes, got {data.size}")
    if qtype == "f32":
        return data.view(np.float32).reshape(shape).copy()
    if qtype == "f16":
        return data.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == "bf16":
        # bf16 is the top half of an f32: widen and shift.
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blocks = data.reshape(-1, size)
    out = np.empty((blocks.shape[0], elems), np.float32)
    fn = _DEQUANT[qtype]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = np.asarray(blocks[start:start + _CHUNK_BLOCKS])
        out[start:start + _CHUNK_BLOCKS] = fn(chunk)
    return out.reshape(shape)

