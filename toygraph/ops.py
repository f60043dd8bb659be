"""The ops: for every op, its builder function, its shape/dtype rule and its backward rule,
entered in the op table (optable.py). The fused ops (attention, linear_cross_entropy and
unpack) live in ops_fused.py and are re-exported here, so ``ops.<name>`` is every op.

Adding an op means one ``define_op(...)`` entry (with the builder function beside it), one
numpy kernel in cpu/kernels.py, one CUDA kernel, and one finite-difference gradient test.
"""
from __future__ import annotations

import numpy as np

from .errors import GraphError
from .optable import (F32, I32, INT32_MAX, LABELS, NONE, OPS, check,  # noqa: F401 (OPS)
                      check_floats, define_op, make_node)
from .ops_fused import attention, linear_cross_entropy, unpack  # noqa: F401 (ops' API)
from .ops_pref import log1mexp, log_sigmoid, softplus, token_logprobs  # noqa: F401 (ops' API)
from .ops_cache import cache_write  # noqa: F401 (ops' API; generation's KV cache)

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
    return make_node("sum_to", [x], shape=tuple(shape))


def expand(x, shape):
    """Inverse of sum_to: broadcast ``x`` up to ``shape`` (repeating grouped dims)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return make_node("expand", [x], shape=tuple(shape))


def _infer_sum_to(shapes, dtypes, attrs):
    target = attrs["shape"]
    check(_broadcast(shapes[0], target, allow_groups=True) == tuple(shapes[0]),
          f"cannot reduce {shapes[0]} to {target}")
    return target, dtypes[0]


def _infer_expand(shapes, dtypes, attrs):
    target = attrs["shape"]
    check(_broadcast(target, shapes[0], allow_groups=True) == tuple(target),
          f"cannot expand {shapes[0]} to {target}")
    return target, dtypes[0]


define_op("sum_to", _infer_sum_to, lambda n, g, need: [expand(g, n.srcs[0].shape)])
define_op("expand", _infer_expand, lambda n, g, need: [sum_to(g, n.srcs[0].shape)])


# --- elementwise ---------------------------------------------------------------------------
def _infer_binary(shapes, dtypes, attrs):
    check_floats(dtypes)
    return _broadcast(shapes[0], shapes[1]), F32


def add(a, b):
    return make_node("add", [a, b])


def sub(a, b):
    return make_node("sub", [a, b])


def mul(a, b):
    return make_node("mul", [a, b])


def scale(x, s: float):
    return make_node("scale", [x], s=float(s))


define_op("add", _infer_binary, lambda n, g, need: [sum_to(g, s.shape) for s in n.srcs])
define_op("sub", _infer_binary,
    lambda n, g, need: [sum_to(g, n.srcs[0].shape), sum_to(scale(g, -1.0), n.srcs[1].shape)])
define_op("mul", _infer_binary, lambda n, g, need: [
    sum_to(mul(g, n.srcs[1]), n.srcs[0].shape) if need[0] else None,
    sum_to(mul(g, n.srcs[0]), n.srcs[1].shape) if need[1] else None])


def _infer_unary(shapes, dtypes, attrs):
    check_floats(dtypes)
    return shapes[0], F32


define_op("scale", _infer_unary, lambda n, g, need: [scale(g, n.attrs["s"])])


def silu(x):
    return make_node("silu", [x])


def silu_back(x, g):
    return make_node("silu_back", [x, g])


def swiglu(gate, up):
    """silu(gate) * up, the Llama FFN activation."""
    return mul(silu(gate), up)


def _infer_same2(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(shapes[0] == shapes[1], f"shapes must match, got {shapes[0]} and {shapes[1]}")
    return shapes[0], F32


define_op("silu", _infer_unary, lambda n, g, need: [silu_back(n.srcs[0], g)])
define_op("silu_back", _infer_same2)


def gelu(x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), exactly
    torch's ``gelu(approximate="tanh")`` (Hugging Face's ``gelu_pytorch_tanh``, Gemma)."""
    return make_node("gelu", [x])


def gelu_back(x, g):
    return make_node("gelu_back", [x, g])


def geglu(gate, up):
    """gelu(gate) * up, the Gemma FFN activation."""
    return mul(gelu(gate), up)


define_op("gelu", _infer_unary, lambda n, g, need: [gelu_back(n.srcs[0], g)])
define_op("gelu_back", _infer_same2)


# --- normalisation, rope, softmax ----------------------------------------------------------
def rms_norm(x, eps: float):
    """x / sqrt(mean(x^2, last axis) + eps); multiply by a weight separately."""
    return make_node("rms_norm", [x], eps=float(eps))


define_op("rms_norm", _infer_unary,
    lambda n, g, need: [make_node("rms_norm_back", [n.srcs[0], g], eps=n.attrs["eps"])])
define_op("rms_norm_back", _infer_same2)


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
    return make_node("rope", srcs, dims=int(dims), base=float(base), mode=mode,
                     freq_scale=float(freq_scale), inverse=bool(inverse))


def _infer_rope(shapes, dtypes, attrs):
    (xs, ps), (xd, pd) = shapes[:2], dtypes[:2]
    check(xd == F32 and pd == I32, "rope needs f32 x and i32 positions")
    check(len(xs) == 4, f"x must be [batch, seq, heads, head_dim], got {xs}")
    check(tuple(ps) == tuple(xs[:2]), f"positions must be {xs[:2]}, got {ps}")
    check(attrs["mode"] in ("normal", "neox"),
          f"mode must be normal or neox, got {attrs['mode']!r}")
    d = attrs["dims"]
    check(0 < d <= xs[3] and d % 2 == 0, f"rope dims must be even and <= {xs[3]}, got {d}")
    check(attrs["freq_scale"] > 0, f"freq_scale must be positive, got {attrs['freq_scale']}")
    if len(shapes) == 3:
        check(dtypes[2] == F32 and tuple(shapes[2]) == (d // 2,),
              f"freq_factors must be f32 [{d // 2}] (dims / 2), got {dtypes[2]} {shapes[2]}")
    return xs, F32


def _grad_rope(n, g, need):
    a = n.attrs
    factors = n.srcs[2] if len(n.srcs) == 3 else None
    dx = rope(g, n.srcs[1], dims=a["dims"], base=a["base"], mode=a["mode"],
              freq_factors=factors, freq_scale=a["freq_scale"], inverse=not a["inverse"])
    return [dx] + [None] * (len(n.srcs) - 1)


define_op("rope", _infer_rope, _grad_rope,
    id_ranges=lambda n: {1: (0, INT32_MAX, "positions")})


def softmax(x, *, scale: float = 1.0, causal: bool = False):
    """softmax(scale * x) over the last axis; ``causal`` masks key j > query i on the last
    two axes [queries, keys]."""
    return make_node("softmax", [x], scale=float(scale), causal=bool(causal))


def _infer_softmax(shapes, dtypes, attrs):
    check_floats(dtypes)
    if attrs["causal"]:
        s = shapes[0]
        check(len(s) >= 2 and s[-1] == s[-2], f"causal softmax needs [.., T, T], got {s}")
    return shapes[0], F32


define_op("softmax", _infer_softmax,
    lambda n, g, need: [make_node("softmax_back", [n, g], scale=n.attrs["scale"])])
define_op("softmax_back", _infer_same2)


# --- matmul ----------------------------------------------------------------------------------
def matmul(a, b, *, trans_a=False, trans_b=False):
    """a @ b over the last two axes, batch axes broadcast. ``b`` may have fewer heads
    than ``a`` (grouped-query attention); a 2-D ``b`` is a weight shared by every batch."""
    return make_node("matmul", [a, b], trans_a=bool(trans_a), trans_b=bool(trans_b))


def _mat_dims(shape, trans):
    m, k = shape[-2], shape[-1]
    return (k, m) if trans else (m, k)


def _infer_matmul(shapes, dtypes, attrs):
    check_floats(dtypes)
    a, b = shapes
    check(len(a) >= 2 and len(b) >= 2, f"matmul needs >= 2-D operands, got {a} and {b}")
    m, k = _mat_dims(a, attrs["trans_a"])
    k2, n = _mat_dims(b, attrs["trans_b"])
    check(k == k2, f"inner dimensions differ: {k} vs {k2}")
    batch = _broadcast(a[:-2], b[:-2], allow_groups=True)
    check(len(b) == 2 or len(a) >= len(b), "b may not have more batch axes than a")
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


define_op("matmul", _infer_matmul, _grad_matmul)


# --- shape ops -------------------------------------------------------------------------------
def reshape(x, shape):
    shape = tuple(int(s) for s in shape)
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        check(known > 0 and x.size % known == 0, f"reshape {x.shape} -> {shape}: sizes differ")
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    return make_node("reshape", [x], shape=shape)


def _infer_reshape(shapes, dtypes, attrs):
    check(int(np.prod(shapes[0])) == int(np.prod(attrs["shape"])),
          f"cannot reshape {shapes[0]} to {attrs['shape']}")
    return attrs["shape"], dtypes[0]


define_op("reshape", _infer_reshape, lambda n, g, need: [reshape(g, n.srcs[0].shape)])


def permute(x, axes):
    axes = tuple(a % x.ndim for a in axes) if x.ndim else tuple(axes)
    return make_node("permute", [x], axes=axes)


def _infer_permute(shapes, dtypes, attrs):
    axes = attrs["axes"]
    check(sorted(axes) == list(range(len(shapes[0]))),
          f"axes {axes} are not a permutation of {len(shapes[0])} axes")
    return tuple(shapes[0][i] for i in axes), dtypes[0]


define_op("permute", _infer_permute,
    lambda n, g, need: [permute(g, tuple(np.argsort(n.attrs["axes"])))])


def contiguous(x):
    """A copy in row-major layout (numpy's arrays always are; CUDA may need the copy)."""
    return make_node("contiguous", [x])


define_op("contiguous", lambda s, d, a: (s[0], d[0]), lambda n, g, need: [g])


# --- reductions ------------------------------------------------------------------------------
def sum(x, axis=None):  # noqa: A001 - mirrors numpy's name on purpose
    return make_node("sum", [x], axis=None if axis is None else int(axis) % x.ndim)


def mean(x, axis=None):
    n = x.size if axis is None else x.shape[axis]
    return scale(sum(x, axis), 1.0 / n)


def _infer_sum(shapes, dtypes, attrs):
    check_floats(dtypes)
    ax = attrs["axis"]
    return (() if ax is None else tuple(s for i, s in enumerate(shapes[0]) if i != ax)), F32


def _grad_sum(n, g, need):
    x, ax = n.srcs[0], n.attrs["axis"]
    keep = tuple(1 if ax is None or i == ax else s for i, s in enumerate(x.shape))
    return [expand(reshape(g, keep), x.shape)]


define_op("sum", _infer_sum, _grad_sum)


# --- embedding and loss ----------------------------------------------------------------------
def get_rows(table, ids):
    """table[ids]: rows of a [rows, dim] table gathered by integer ids of any shape."""
    return make_node("get_rows", [table, ids])


def _infer_get_rows(shapes, dtypes, attrs):
    check(dtypes[0] == F32 and dtypes[1] == I32, "get_rows needs an f32 table and i32 ids")
    check(len(shapes[0]) == 2, f"table must be 2-D, got {shapes[0]}")
    return tuple(shapes[1]) + (shapes[0][1],), F32


def _infer_get_rows_back(shapes, dtypes, attrs):
    return (attrs["rows"], shapes[0][-1]), F32


define_op("get_rows", _infer_get_rows, lambda n, g, need: [
    make_node("get_rows_back", [g, n.srcs[1]], rows=n.srcs[0].shape[0]), None],
    id_ranges=lambda n: {1: (0, n.srcs[0].shape[0], f"rows of {n.srcs[0].name}")})
define_op("get_rows_back", _infer_get_rows_back)


def cross_entropy(logits, labels, reduction="mean"):
    """Cross-entropy of logits [N, vocab] against integer labels [N]; label -1 is ignored.

    ``mean`` divides by the number of labels that are not ignored (0 when all are);
    ``sum`` does not divide, for token-weighted gradient accumulation."""
    return make_node("cross_entropy", [logits, labels], reduction=reduction)


def count_valid(labels):
    """The number of labels that are not -1, as an f32 scalar."""
    return make_node("count_valid", [labels])


def _infer_ce(shapes, dtypes, attrs):
    check(dtypes == [F32, I32], "cross_entropy needs f32 logits and i32 labels")
    check(len(shapes[0]) == 2 and tuple(shapes[1]) == shapes[0][:1],
          f"logits must be [N, vocab] and labels [N], got {shapes[0]} and {shapes[1]}")
    check(attrs["reduction"] in ("mean", "sum"), "reduction must be mean or sum")
    return (), F32


def _infer_ce_back(shapes, dtypes, attrs):
    return shapes[0], F32


define_op("cross_entropy", _infer_ce, lambda n, g, need: [
    make_node("cross_entropy_back", [n.srcs[0], n.srcs[1], g],
              reduction=n.attrs["reduction"]),
    None], id_ranges=lambda n: {1: (-1, n.srcs[0].shape[1], LABELS)})
define_op("cross_entropy_back", _infer_ce_back)
define_op("count_valid",
          lambda s, d, a: (check(d[0] == I32, "labels must be i32") or ((), F32)),
          id_ranges=lambda n: {0: (-1, INT32_MAX, "labels (-1 to ignore)")})


# --- training side effects (no gradient; they write param/state buffers) -----------------------
def accumulate(acc, value):
    """acc += value, in place (gradient accumulation across micro-batches)."""
    return make_node("accumulate", [acc, value])


def _infer_accumulate(shapes, dtypes, attrs):
    check(shapes[0] == shapes[1], f"accumulator {shapes[0]} and value {shapes[1]} differ")
    return (), NONE


def global_norm(grads, divisor):
    """sqrt(sum of squares of every grad) / divisor — the global gradient norm."""
    return make_node("global_norm", list(grads) + [divisor])


def _infer_global_norm(shapes, dtypes, attrs):
    check_floats(dtypes)
    check(shapes[-1] == (), "the divisor must be a scalar")
    return (), F32


def adamw(param, grad, m, v, hp, norm, divisor, *, max_norm: float):
    """One AdamW update in place of param, m and v, from the accumulated ``grad``.

    The gradient used is grad / divisor, scaled by min(1, max_norm / norm) when max_norm > 0;
    ``hp`` is the 7-value row [lr, b1, b2, eps, wd, 1/(1-b1^t), 1/(1-b2^t)].
    """
    return make_node("adamw", [param, grad, m, v, hp, norm, divisor], max_norm=float(max_norm))


def _infer_adamw(shapes, dtypes, attrs):
    check_floats(dtypes)
    p, g, m, v, hp, norm, div = shapes
    check(p == g == m == v, f"param, grad and moments must share a shape, got {p} {g} {m} {v}")
    check(hp == (7,), f"hp must be the 7-value row, got {hp}")
    check(norm == () and div == (), "norm and divisor must be scalars")
    return (), NONE


define_op("accumulate", _infer_accumulate)
define_op("global_norm", _infer_global_norm)
define_op("adamw", _infer_adamw)

# Ops that write into their first operand(s) rather than producing a value.
SIDE_EFFECTS = {"accumulate", "adamw"}
