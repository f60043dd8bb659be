"""The op table: for every op, its shape/dtype rule and its backward rule.

Adding an op means one ``_op(...)`` entry here (with the builder function beside it), one
numpy kernel in cpu/kernels.py, one CUDA kernel, and one finite-difference gradient test.

A backward rule gets the node, the gradient of its output and a list saying which sources
need a gradient; it returns one gradient Tensor (or None) per source, built from more ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import GraphError

F32, I32, NONE = "f32", "i32", "none"


@dataclass(frozen=True)
class OpSpec:
    name: str
    infer: Callable       # (shapes, dtypes, attrs) -> (shape, dtype); raises GraphError
    grad: Callable | None  # (node, gout, need) -> [grad or None per src]
    # For ops that index with integer operands: {src index: (low, high, what)}, the range
    # [low, high) those values must lie in. Sessions check uploads against it, so a bad
    # id is a clear error on the host, never an out-of-bounds read in a kernel.
    id_ranges: Callable | None = None  # (node) -> dict[int, tuple[int, int, str]]


OPS: dict[str, OpSpec] = {}
INT32_MAX = 2 ** 31 - 1


def _op(name, infer, grad=None, id_ranges=None):
    OPS[name] = OpSpec(name, infer, grad, id_ranges)


def _need(cond, msg):
    if not cond:
        raise GraphError(msg)


def _floats(dtypes, n=None):
    for i, d in enumerate(dtypes if n is None else dtypes[:n]):
        _need(d == F32, f"operand {i} must be f32, got {d}")


def _node(op, srcs, **attrs):
    return srcs[0].graph.node(op, srcs, attrs)


# --- broadcasting, including grouped-query sharing ---------------------------------------
def _broadcast(a, b, allow_groups=False):
    """numpy broadcasting of two shapes; with ``allow_groups`` a dim of ``a`` that is a
    multiple of ``b``'s broadcasts too (grouped-query attention: query head h uses
    K/V head h // (Hq/Hkv)), and the result takes ``a``'s size."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif allow_groups and x % y == 0:
            out.append(x)
        else:
            raise GraphError(f"shapes {a} and {b} do not broadcast")
    return tuple(out)


def sum_to(x, shape):
    """Reduce ``x`` to ``shape``: sums broadcast dims and groups of a grouped dim."""
    if tuple(x.shape) == tuple(shape):
        return x
    return _node("sum_to", [x], shape=tuple(shape))


def expand(x, shape):
    """Inverse of sum_to: broadcast ``x`` up to ``shape`` (repeating grouped dims)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return _node("expand", [x], shape=tuple(shape))


def _infer_sum_to(shapes, dtypes, attrs):
    target = attrs["shape"]
    _need(_broadcast(shapes[0], target, allow_groups=True) == tuple(shapes[0]),
          f"cannot reduce {shapes[0]} to {target}")
    return target, dtypes[0]


def _infer_expand(shapes, dtypes, attrs):
    target = attrs["shape"]
    _need(_broadcast(target, shapes[0], allow_groups=True) == tuple(target),
          f"cannot expand {shapes[0]} to {target}")
    return target, dtypes[0]


_op("sum_to", _infer_sum_to, lambda n, g, need: [expand(g, n.srcs[0].shape)])
_op("expand", _infer_expand, lambda n, g, need: [sum_to(g, n.srcs[0].shape)])


# --- elementwise ---------------------------------------------------------------------------
def _infer_binary(shapes, dtypes, attrs):
    _floats(dtypes)
    return _broadcast(shapes[0], shapes[1]), F32


def add(a, b):
    return _node("add", [a, b])


def sub(a, b):
    return _node("sub", [a, b])


def mul(a, b):
    return _node("mul", [a, b])


def scale(x, s: float):
    return _node("scale", [x], s=float(s))


_op("add", _infer_binary, lambda n, g, need: [sum_to(g, s.shape) for s in n.srcs])
_op("sub", _infer_binary,
    lambda n, g, need: [sum_to(g, n.srcs[0].shape), sum_to(scale(g, -1.0), n.srcs[1].shape)])
_op("mul", _infer_binary, lambda n, g, need: [
    sum_to(mul(g, n.srcs[1]), n.srcs[0].shape) if need[0] else None,
    sum_to(mul(g, n.srcs[0]), n.srcs[1].shape) if need[1] else None])


def _infer_unary(shapes, dtypes, attrs):
    _floats(dtypes)
    return shapes[0], F32


_op("scale", _infer_unary, lambda n, g, need: [scale(g, n.attrs["s"])])


def silu(x):
    return _node("silu", [x])


def silu_back(x, g):
    return _node("silu_back", [x, g])


def swiglu(gate, up):
    """silu(gate) * up, the Llama FFN activation."""
    return mul(silu(gate), up)


def _infer_same2(shapes, dtypes, attrs):
    _floats(dtypes)
    _need(shapes[0] == shapes[1], f"shapes must match, got {shapes[0]} and {shapes[1]}")
    return shapes[0], F32


_op("silu", _infer_unary, lambda n, g, need: [silu_back(n.srcs[0], g)])
_op("silu_back", _infer_same2)


def gelu(x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), exactly
    torch's ``gelu(approximate="tanh")`` (Hugging Face's ``gelu_pytorch_tanh``, Gemma)."""
    return _node("gelu", [x])


def gelu_back(x, g):
    return _node("gelu_back", [x, g])


def geglu(gate, up):
    """gelu(gate) * up, the Gemma FFN activation."""
    return mul(gelu(gate), up)


_op("gelu", _infer_unary, lambda n, g, need: [gelu_back(n.srcs[0], g)])
_op("gelu_back", _infer_same2)


# --- normalisation, rope, softmax ----------------------------------------------------------
def rms_norm(x, eps: float):
    """x / sqrt(mean(x^2, last axis) + eps); multiply by a weight separately."""
    return _node("rms_norm", [x], eps=float(eps))


_op("rms_norm", _infer_unary,
    lambda n, g, need: [_node("rms_norm_back", [n.srcs[0], g], eps=n.attrs["eps"])])
_op("rms_norm_back", _infer_same2)


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
    return _node("rope", srcs, dims=int(dims), base=float(base), mode=mode,
                 freq_scale=float(freq_scale), inverse=bool(inverse))


def _infer_rope(shapes, dtypes, attrs):
    (xs, ps), (xd, pd) = shapes[:2], dtypes[:2]
    _need(xd == F32 and pd == I32, "rope needs f32 x and i32 positions")
    _need(len(xs) == 4, f"x must be [batch, seq, heads, head_dim], got {xs}")
    _need(tuple(ps) == tuple(xs[:2]), f"positions must be {xs[:2]}, got {ps}")
    _need(attrs["mode"] in ("normal", "neox"), f"mode must be normal or neox, got {attrs['mode']!r}")
    d = attrs["dims"]
    _need(0 < d <= xs[3] and d % 2 == 0, f"rope dims must be even and <= {xs[3]}, got {d}")
    _need(attrs["freq_scale"] > 0, f"freq_scale must be positive, got {attrs['freq_scale']}")
    if len(shapes) == 3:
        _need(dtypes[2] == F32 and tuple(shapes[2]) == (d // 2,),
              f"freq_factors must be f32 [{d // 2}] (dims / 2), got {dtypes[2]} {shapes[2]}")
    return xs, F32


def _grad_rope(n, g, need):
    a = n.attrs
    factors = n.srcs[2] if len(n.srcs) == 3 else None
    dx = rope(g, n.srcs[1], dims=a["dims"], base=a["base"], mode=a["mode"],
              freq_factors=factors, freq_scale=a["freq_scale"], inverse=not a["inverse"])
    return [dx] + [None] * (len(n.srcs) - 1)


_op("rope", _infer_rope, _grad_rope,
    id_ranges=lambda n: {1: (0, INT32_MAX, "positions")})


def softmax(x, *, scale: float = 1.0, causal: bool = False):
    """softmax(scale * x) over the last axis; ``causal`` masks key j > query i on the last
    two axes [queries, keys]."""
    return _node("softmax", [x], scale=float(scale), causal=bool(causal))


def _infer_softmax(shapes, dtypes, attrs):
    _floats(dtypes)
    if attrs["causal"]:
        s = shapes[0]
        _need(len(s) >= 2 and s[-1] == s[-2], f"causal softmax needs [.., T, T], got {s}")
    return shapes[0], F32


_op("softmax", _infer_softmax,
    lambda n, g, need: [_node("softmax_back", [n, g], scale=n.attrs["scale"])])
_op("softmax_back", _infer_same2)


# --- fused attention -------------------------------------------------------------------------
def attention(q, k, v, *, scale: float, causal: bool = True, window: int = 0):
    """softmax(scale * q k^T [causal-masked]) v without a [heads, seq, seq] tensor.

    ``window`` > 0 is sliding-window causal attention (Gemma 3's local layers): query i
    sees key j iff j <= i and i - j < window. That is transformers' sliding overlay
    (masking_utils.sliding_window_overlay: ``kv_idx > q_idx - sliding_window``) and
    llama.cpp's LLAMA_SWA_TYPE_STANDARD (is_masked_swa masks ``p1 - p0 >= n_swa``).
    0 means no window.

    q [B, H, T, hd], k and v [B, KV, T, hd] with H % KV == 0: query head h reads K/V head
    h // (H / KV) (grouped-query). Returns [B, H, T, hd]. The gradient is one
    ``attention_back`` node (dq, dk and dv together, the way a flash-style kernel makes
    them) read through three ``unpack`` views.

    >>> o = attention(q, k, v, scale=hd ** -0.5)          # doctest: +SKIP
    """
    return _node("attention", [q, k, v], scale=float(scale), causal=bool(causal),
                 window=int(window))


def _infer_attention(shapes, dtypes, attrs):
    _floats(dtypes)
    q, k, v = shapes[:3]
    _need(len(q) == 4 and len(k) == 4, f"q must be [B, H, T, hd] and k, v [B, KV, T, hd], "
                                       f"got {q} and {k}")
    _need(tuple(k) == tuple(v), f"k and v must share a shape, got {k} and {v}")
    _need(q[0] == k[0] and q[2] == k[2] and q[3] == k[3],
          f"q {q} and k {k} must agree on batch, sequence and head_dim")
    _need(q[1] % k[1] == 0, f"query heads {q[1]} must be a multiple of kv heads {k[1]}")
    _need(attrs["window"] >= 0, f"window must be >= 0 (0: none), got {attrs['window']}")
    _need(attrs["causal"] or not attrs["window"], "a sliding window needs causal=True")
    return tuple(q), F32


def _infer_attention_back(shapes, dtypes, attrs):
    q, k, v, o, g = shapes
    _infer_attention([q, k, v], dtypes[:3], attrs)
    _floats(dtypes)
    _need(tuple(o) == tuple(q) and tuple(g) == tuple(q),
          f"output {o} and its gradient {g} must have q's shape {q}")
    return (int(np.prod(q)) + 2 * int(np.prod(k)),), F32


def _grad_attention(n, g, need):
    back = _node("attention_back", [*n.srcs, n, g], **n.attrs)
    grads, offset = [], 0
    for s, nd in zip(n.srcs, need):
        grads.append(unpack(back, offset, s.shape) if nd else None)
        offset += s.size
    return grads


def unpack(x, offset: int, shape):
    """Elements [offset, offset + prod(shape)) of x (read flat) as a tensor of ``shape``:
    how one node that packs several results (attention_back) hands them out."""
    return _node("unpack", [x], offset=int(offset), shape=tuple(int(s) for s in shape))


def _infer_unpack(shapes, dtypes, attrs):
    off, shape = attrs["offset"], attrs["shape"]
    size = int(np.prod(shapes[0]))
    _need(all(s > 0 for s in shape), f"unpack shape must be positive, got {shape}")
    _need(0 <= off and off + int(np.prod(shape)) <= size,
          f"unpack [{off}, {off + int(np.prod(shape))}) lies outside {size} elements")
    return shape, dtypes[0]


_op("attention", _infer_attention, _grad_attention)
_op("attention_back", _infer_attention_back)
_op("unpack", _infer_unpack)


# --- matmul ----------------------------------------------------------------------------------
def matmul(a, b, *, trans_a=False, trans_b=False):
    """a @ b over the last two axes, batch axes broadcast. ``b`` may have fewer heads
    than ``a`` (grouped-query attention); a 2-D ``b`` is a weight shared by every batch."""
    return _node("matmul", [a, b], trans_a=bool(trans_a), trans_b=bool(trans_b))


def _mat_dims(shape, trans):
    m, k = shape[-2], shape[-1]
    return (k, m) if trans else (m, k)


def _infer_matmul(shapes, dtypes, attrs):
    _floats(dtypes)
    a, b = shapes
    _need(len(a) >= 2 and len(b) >= 2, f"matmul needs >= 2-D operands, got {a} and {b}")
    m, k = _mat_dims(a, attrs["trans_a"])
    k2, n = _mat_dims(b, attrs["trans_b"])
    _need(k == k2, f"inner dimensions differ: {k} vs {k2}")
    batch = _broadcast(a[:-2], b[:-2], allow_groups=True)
    _need(len(b) == 2 or len(a) >= len(b), "b may not have more batch axes than a")
    return batch + (m, n), F32


def _grad_matmul(n, g, need):
    (a, b), ta, tb = n.srcs, n.attrs["trans_a"], n.attrs["trans_b"]
    ga = gb = None
    if need[0]:  # dA = dC B^T (or its transpose when A was transposed)
        ga = matmul(b, g, trans_a=tb, trans_b=True) if ta else matmul(g, b, trans_b=not tb)
        ga = sum_to(ga, a.shape)
    if need[1]:
        if b.ndim == 2 and a.ndim > 2 and not ta:
            # A weight shared by every batch row: fold the batch axes into M so dB is one
            # 2-D matmul instead of a per-batch product summed afterwards.
            af, gf = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
            gb = matmul(gf, af, trans_a=True) if tb else matmul(af, gf, trans_a=True)
        else:  # dB = A^T dC (or its transpose)
            gb = matmul(g, a, trans_a=True, trans_b=ta) if tb else matmul(a, g, trans_a=not ta)
            gb = sum_to(gb, b.shape)
    return [ga, gb]


_op("matmul", _infer_matmul, _grad_matmul)


# --- shape ops -------------------------------------------------------------------------------
def reshape(x, shape):
    shape = tuple(int(s) for s in shape)
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        _need(known > 0 and x.size % known == 0, f"reshape {x.shape} -> {shape}: sizes differ")
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    return _node("reshape", [x], shape=shape)


def _infer_reshape(shapes, dtypes, attrs):
    _need(int(np.prod(shapes[0])) == int(np.prod(attrs["shape"])),
          f"cannot reshape {shapes[0]} to {attrs['shape']}")
    return attrs["shape"], dtypes[0]


_op("reshape", _infer_reshape, lambda n, g, need: [reshape(g, n.srcs[0].shape)])


def permute(x, axes):
    axes = tuple(a % x.ndim for a in axes) if x.ndim else tuple(axes)
    return _node("permute", [x], axes=axes)


def _infer_permute(shapes, dtypes, attrs):
    axes = attrs["axes"]
    _need(sorted(axes) == list(range(len(shapes[0]))),
          f"axes {axes} are not a permutation of {len(shapes[0])} axes")
    return tuple(shapes[0][i] for i in axes), dtypes[0]


_op("permute", _infer_permute,
    lambda n, g, need: [permute(g, tuple(np.argsort(n.attrs["axes"])))])


def contiguous(x):
    """A copy in row-major layout (numpy's arrays always are; CUDA may need the copy)."""
    return _node("contiguous", [x])


_op("contiguous", lambda s, d, a: (s[0], d[0]), lambda n, g, need: [g])


# --- reductions ------------------------------------------------------------------------------
def sum(x, axis=None):  # noqa: A001 - mirrors numpy's name on purpose
    return _node("sum", [x], axis=None if axis is None else int(axis) % x.ndim)


def mean(x, axis=None):
    n = x.size if axis is None else x.shape[axis]
    return scale(sum(x, axis), 1.0 / n)


def _infer_sum(shapes, dtypes, attrs):
    _floats(dtypes)
    ax = attrs["axis"]
    return (() if ax is None else tuple(s for i, s in enumerate(shapes[0]) if i != ax)), F32


def _grad_sum(n, g, need):
    x, ax = n.srcs[0], n.attrs["axis"]
    keep = tuple(1 if ax is None or i == ax else s for i, s in enumerate(x.shape))
    return [expand(reshape(g, keep), x.shape)]


_op("sum", _infer_sum, _grad_sum)


# --- embedding and loss ----------------------------------------------------------------------
def get_rows(table, ids):
    """table[ids]: rows of a [rows, dim] table gathered by integer ids of any shape."""
    return _node("get_rows", [table, ids])


def _infer_get_rows(shapes, dtypes, attrs):
    _need(dtypes[0] == F32 and dtypes[1] == I32, "get_rows needs an f32 table and i32 ids")
    _need(len(shapes[0]) == 2, f"table must be 2-D, got {shapes[0]}")
    return tuple(shapes[1]) + (shapes[0][1],), F32


def _infer_get_rows_back(shapes, dtypes, attrs):
    return (attrs["rows"], shapes[0][-1]), F32


_op("get_rows", _infer_get_rows, lambda n, g, need: [
    _node("get_rows_back", [g, n.srcs[1]], rows=n.srcs[0].shape[0]), None],
    id_ranges=lambda n: {1: (0, n.srcs[0].shape[0], f"rows of {n.srcs[0].name}")})
_op("get_rows_back", _infer_get_rows_back)


def cross_entropy(logits, labels, reduction="mean"):
    """Cross-entropy of logits [N, vocab] against integer labels [N]; label -1 is ignored.

    ``mean`` divides by the number of labels that are not ignored (0 when all are);
    ``sum`` does not divide, for token-weighted gradient accumulation."""
    return _node("cross_entropy", [logits, labels], reduction=reduction)


def count_valid(labels):
    """The number of labels that are not -1, as an f32 scalar."""
    return _node("count_valid", [labels])


def _infer_ce(shapes, dtypes, attrs):
    _need(dtypes == [F32, I32], "cross_entropy needs f32 logits and i32 labels")
    _need(len(shapes[0]) == 2 and tuple(shapes[1]) == shapes[0][:1],
          f"logits must be [N, vocab] and labels [N], got {shapes[0]} and {shapes[1]}")
    _need(attrs["reduction"] in ("mean", "sum"), "reduction must be mean or sum")
    return (), F32


def _infer_ce_back(shapes, dtypes, attrs):
    return shapes[0], F32


_LABELS = "the vocabulary (or -1 to ignore)"
_op("cross_entropy", _infer_ce, lambda n, g, need: [
    _node("cross_entropy_back", [n.srcs[0], n.srcs[1], g], reduction=n.attrs["reduction"]),
    None], id_ranges=lambda n: {1: (-1, n.srcs[0].shape[1], _LABELS)})
_op("cross_entropy_back", _infer_ce_back)
_op("count_valid", lambda s, d, a: (_need(d[0] == I32, "labels must be i32") or ((), F32)),
    id_ranges=lambda n: {0: (-1, INT32_MAX, "labels (-1 to ignore)")})


def linear_cross_entropy(h, w, labels, reduction="mean"):
    """cross_entropy(matmul(h, w, trans_b=True), labels, reduction) without [N, vocab] logits.

    h [N, D] hidden states, w [V, D] the output head (a frozen, possibly quantized const or
    a trainable param), labels [N] i32 with -1 ignored. The kernels walk the rows in chunks,
    so only a [chunk, V] block of logits exists at a time, forward and backward (which
    recomputes it). The gradient is one ``linear_cross_entropy_back`` node packing dh and,
    only when w needs one, dw, read through ``unpack``.

    >>> loss = linear_cross_entropy(h, head, labels, reduction="sum")   # doctest: +SKIP
    """
    return _node("linear_cross_entropy", [h, w, labels], reduction=reduction)


def _infer_lce(shapes, dtypes, attrs):
    (hs, ws, ls), (hd, wd, ld) = shapes, dtypes
    _need(hd == F32 and wd == F32 and ld == I32,
          f"linear_cross_entropy needs f32 h and w and i32 labels, got {hd}, {wd}, {ld}")
    _need(len(hs) == 2 and len(ws) == 2 and hs[1] == ws[1],
          f"h must be [N, D] and w [V, D], got {hs} and {ws}")
    _need(tuple(ls) == tuple(hs[:1]), f"labels must be [{hs[0]}], got {ls}")
    _need(attrs["reduction"] in ("mean", "sum"), "reduction must be mean or sum")
    return (), F32


def _infer_lce_back(shapes, dtypes, attrs):
    _infer_lce(shapes[:3], dtypes[:3], attrs)
    _need(tuple(shapes[3]) == () and dtypes[3] == F32, f"the loss gradient must be an f32 "
                                                        f"scalar, got {shapes[3]}")
    _need(attrs["grad_h"] or attrs["grad_w"], "linear_cross_entropy_back computes nothing")
    (n, d), v = shapes[0], shapes[1][0]
    return (n * d * attrs["grad_h"] + v * d * attrs["grad_w"],), F32


def _grad_lce(n, g, need):
    h, w, _ = n.srcs
    back = _node("linear_cross_entropy_back", [*n.srcs, g], reduction=n.attrs["reduction"],
                 grad_h=bool(need[0]), grad_w=bool(need[1]))
    dh = unpack(back, 0, h.shape) if need[0] else None
    dw = unpack(back, h.size * need[0], w.shape) if need[1] else None
    return [dh, dw, None]


_op("linear_cross_entropy", _infer_lce, _grad_lce,
    id_ranges=lambda n: {2: (-1, n.srcs[1].shape[0], _LABELS)})
_op("linear_cross_entropy_back", _infer_lce_back)


# --- training side effects (no gradient; they write param/state buffers) -----------------------
def accumulate(acc, value):
    """acc += value, in place (gradient accumulation across micro-batches)."""
    return _node("accumulate", [acc, value])


def _infer_accumulate(shapes, dtypes, attrs):
    _need(shapes[0] == shapes[1], f"accumulator {shapes[0]} and value {shapes[1]} differ")
    return (), NONE


def global_norm(grads, divisor):
    """sqrt(sum of squares of every grad) / divisor — the global gradient norm."""
    return _node("global_norm", list(grads) + [divisor])


def _infer_global_norm(shapes, dtypes, attrs):
    _floats(dtypes)
    _need(shapes[-1] == (), "the divisor must be a scalar")
    return (), F32


def adamw(param, grad, m, v, hp, norm, divisor, *, max_norm: float):
    """One AdamW update in place of param, m and v, from the accumulated ``grad``.

    The gradient used is grad / divisor, scaled by min(1, max_norm / norm) when max_norm > 0;
    ``hp`` is the 7-value row [lr, b1, b2, eps, wd, 1/(1-b1^t), 1/(1-b2^t)].
    """
    return _node("adamw", [param, grad, m, v, hp, norm, divisor], max_norm=float(max_norm))


def _infer_adamw(shapes, dtypes, attrs):
    _floats(dtypes)
    p, g, m, v, hp, norm, div = shapes
    _need(p == g == m == v, f"param, grad and moments must share a shape, got {p} {g} {m} {v}")
    _need(hp == (7,), f"hp must be the 7-value row, got {hp}")
    _need(norm == () and div == (), "norm and divisor must be scalars")
    return (), NONE


_op("accumulate", _infer_accumulate)
_op("global_norm", _infer_global_norm)
_op("adamw", _infer_adamw)

# Ops that write into their first operand(s) rather than producing a value.
SIDE_EFFECTS = {"accumulate", "adamw"}
