"""The optimizer's in-graph ops: accumulate (gradient accumulation), global_norm (the
gradient norm for clipping) and adamw (one update). accumulate and adamw write their
sources in place and produce no value; none of them has a gradient. Builders, shape
rules, numpy kernels and CUDA lowering (update.cu). toygraph/core/optimizer.py builds the update
graph from them."""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.table import F32, NONE, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import Launch, declare_kernels, f32, f64, grid_1d, i32, lowers, p
from toygraph.cuda.lowering.constants import THREADS

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "update.cu")


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


def adamw(param, grad, m, v, hp, norm, divisor, *, max_norm: float, lr_scale: float = 1.0):
    """One AdamW update in place of param, m and v, from the accumulated ``grad``.

    The gradient used is grad / divisor, scaled by min(1, max_norm / norm) when max_norm > 0;
    ``hp`` is the row [lr, b1, b2, eps, wd, 1/(1-b1^t), 1/(1-b2^t), t, micro]. ``lr_scale``
    multiplies this tensor's learning rate (LoRA+: B's rate is lr * ratio), a constant of
    the graph, so every replayed step (and a resumed run) applies the same one; the f32
    product lr * 1.0 is lr exactly, so a scale of 1 changes no bit.
    """
    return make_node("adamw", [param, grad, m, v, hp, norm, divisor], max_norm=float(max_norm),
                     lr_scale=float(lr_scale))


def _infer_adamw(shapes, dtypes, attrs):
    check_floats(dtypes)
    w, g, m, v, hp, norm, div = shapes
    check(w == g == m == v, f"param, grad and moments must share a shape, got {w} {g} {m} {v}")
    check(hp == (9,), f"hp must be the 9-value row (core/optimizer.hp_row), got {hp}")
    check(norm == () and div == (), "norm and divisor must be scalars")
    return (), NONE


define_op("accumulate", _infer_accumulate, in_place=True)
define_op("global_norm", _infer_global_norm)
define_op("adamw", _infer_adamw, in_place=True)


# --- numpy kernels -----------------------------------------------------------------------------
@kernel("accumulate")
def _accumulate_numpy(out, srcs, attrs):
    acc, value = srcs
    acc += value


@kernel("global_norm")
def _global_norm_numpy(out, srcs, attrs):
    *grads, divisor = srcs
    # Accumulate in float64 so the norm does not depend on how many tensors there are.
    sq = 0.0
    for g in grads:
        g64 = g.ravel().astype(np.float64)
        sq += float(np.dot(g64, g64))
    out[...] = np.sqrt(sq) / max(float(divisor), 1.0)


@kernel("adamw")
def _adamw_numpy(out, srcs, attrs):
    w, g, m, v, hp, norm, divisor = srcs
    lr, b1, b2, eps, wd, b1h, b2h = (w.dtype.type(h) for h in hp[:7])
    lr = lr * w.dtype.type(attrs["lr_scale"])
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


# --- CUDA lowering (update.cu) ------------------------------------------------------------------
#: At most this many partial sums per gradient in global_norm (a Python-side choice: the
#: kernels take the count as an argument).
SUMSQ_BLOCKS = 1024


def _sumsq_blocks(n: int) -> int:
    return max(1, min((n + THREADS - 1) // THREADS, SUMSQ_BLOCKS))


def _global_norm_scratch(node) -> int:
    """One f64 partial sum per block of every gradient."""
    return 8 * sum(_sumsq_blocks(g.size) for g in node.srcs[:-1])


@lowers("accumulate", kernels=("tg_accumulate",), has_output=False)
def _accumulate(node, at):
    acc, g = node.srcs
    return [Launch("tg_accumulate", grid_1d(acc.size),
                   [p(at.ptr(acc)), p(at.ptr(g)), i32(acc.size)])]


@lowers("global_norm", kernels=("tg_sumsq_partial", "tg_global_norm"),
        scratch=_global_norm_scratch)
def _global_norm(node, at):
    """Per gradient, partial sums of squares into scratch; then one block adds them up."""
    launches, offset = [], 0
    for g in node.srcs[:-1]:
        nb = _sumsq_blocks(g.size)
        launches.append(Launch("tg_sumsq_partial", (nb, 1, 1),
                               [p(at.scratch + 8 * offset), p(at.ptr(g)), i32(g.size)]))
        offset += nb
    launches.append(Launch("tg_global_norm", (1, 1, 1),
                           [p(at.out), p(at.scratch), i32(offset), p(at.ptr(node.srcs[-1]))]))
    return launches


@lowers("adamw", kernels=("tg_adamw",), has_output=False)
def _adamw(node, at):
    w, g, m, v, hp, norm, div = node.srcs
    return [Launch("tg_adamw", grid_1d(w.size),
                   [p(at.ptr(w)), p(at.ptr(g)), p(at.ptr(m)), p(at.ptr(v)), p(at.ptr(hp)),
                    p(at.ptr(norm)), p(at.ptr(div)), i32(w.size), f64(node.attrs["max_norm"]),
                    f32(node.attrs["lr_scale"])])]
