"""The optimizer's in-graph ops: accumulate (gradient accumulation), global_norm (the
gradient norm for clipping) and adamw (one update of every param). accumulate and adamw write their
sources in place and produce no value; none of them has a gradient. Builders, shape
rules, numpy kernels and CUDA lowering (update.cu). toygraph/core/optimizer.py builds the update
graph from them."""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.groups import IN_PLACE
from toygraph.core.ops.table import F32, NONE, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f64_arg, grid_1d, i32_arg, lowers,
                                    ptr_arg)
from toygraph.cuda.lowering.constants import LIST_TENSORS, THREADS
from toygraph.errors import GraphError

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


def adamw(params, grads, ms, vs, hp, norm, divisor, *, max_norm: float, lr_scales=None):
    """One AdamW update in place of every param and its moments m and v, from its
    accumulated grad: one node for all of them, so CUDA runs it in a few multi-tensor
    launches rather than one per param.

    The gradient used is grad / divisor, scaled by min(1, max_norm / norm) when max_norm > 0;
    ``hp`` is the row [lr, b1, b2, eps, wd, 1/(1-b1^t), 1/(1-b2^t), t, micro]. ``lr_scales``
    (one per param, default 1) multiplies that param's learning rate (LoRA+: B's rate is
    lr * ratio), a constant of the graph, so every replayed step (and a resumed run)
    applies the same one; the f32 product lr * 1.0 is lr exactly, so a scale of 1 changes
    no bit. Each param's update is the one-param update: the result does not depend on
    how params are grouped.
    """
    k = len(params)
    if not k or not len(grads) == len(ms) == len(vs) == k:
        raise GraphError(f"adamw needs one grad, m and v per param, got {k} params, "
                         f"{len(grads)} grads, {len(ms)} m and {len(vs)} v")
    scales = tuple(float(x) for x in (lr_scales if lr_scales is not None else [1.0] * k))
    if len(scales) != k:
        raise GraphError(f"adamw needs one lr scale per param, got {len(scales)} for {k}")
    return make_node("adamw", [*params, *grads, *ms, *vs, hp, norm, divisor],
                     max_norm=float(max_norm), lr_scales=scales)


def adamw_groups(srcs):
    """(w, g, m, v) per param of an adamw node's sources, then (hp, norm, divisor)."""
    k = (len(srcs) - 3) // 4
    return [tuple(srcs[j * k + i] for j in range(4)) for i in range(k)], srcs[-3:]


def _infer_adamw(shapes, dtypes, attrs):
    check_floats(dtypes)
    check((len(shapes) - 3) % 4 == 0, "adamw takes params, grads, m and v, then hp, norm, divisor")
    groups, (hp, norm, div) = adamw_groups(shapes)
    for w, g, m, v in groups:
        check(w == g == m == v, f"param, grad and moments must share a shape, got {w} {g} {m} {v}")
    check(len(attrs["lr_scales"]) == len(groups), "adamw needs one lr scale per param")
    check(hp == (9,), f"hp must be the 9-value row (core/optimizer.hp_row), got {hp}")
    check(norm == () and div == (), "norm and divisor must be scalars")
    return (), NONE


define_op("accumulate", _infer_accumulate, groups={IN_PLACE})
define_op("global_norm", _infer_global_norm)
define_op("adamw", _infer_adamw, groups={IN_PLACE})


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
    groups, (hp, norm, divisor) = adamw_groups(srcs)
    for (w, g, m, v), scale in zip(groups, attrs["lr_scales"]):
        _adamw_one(w, g, m, v, hp, norm, divisor, attrs["max_norm"], scale)


def _adamw_one(w, g, m, v, hp, norm, divisor, max_norm, lr_scale):
    lr, b1, b2, eps, wd, b1h, b2h = (w.dtype.type(h) for h in hp[:7])
    lr = lr * w.dtype.type(lr_scale)
    coef = 1.0 / max(float(divisor), 1.0)
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


def tensor_lists(tensors, blocks):
    """``tensors`` ([(buffers (up to 4 addresses), size, scale), ...]) in launches of up to
    LIST_TENSORS, tensor k given ``blocks(size)`` blocks: [(packed TgTensorList, its blocks)]."""
    T = LIST_TENSORS
    out = []
    for c in range(0, len(tensors), T):
        chunk = tensors[c:c + T]
        ptrs = np.zeros((4, T), np.uint64)
        sizes, scales = np.zeros(T, np.int32), np.zeros(T, np.float32)
        starts = np.zeros(T + 1, np.int32)
        for k, (bufs, n, scale) in enumerate(chunk):
            ptrs[:len(bufs), k] = bufs
            sizes[k], scales[k] = n, scale
            starts[k + 1] = starts[k] + blocks(n)
        starts[len(chunk) + 1:] = starts[len(chunk)]
        packed = b"".join(a.tobytes() for a in (ptrs, sizes, scales, starts,
                                                  np.array([len(chunk)], np.int32)))
        out.append((np.frombuffer(packed, np.uint8).copy(), int(starts[len(chunk)])))
    return out


@lowers("accumulate", kernels=("tg_accumulate",), has_output=False)
def _accumulate(node, at):
    acc, g = node.srcs
    return [Launch("tg_accumulate", grid_1d(acc.size),
                   [ptr_arg(at.ptr(acc)), ptr_arg(at.ptr(g)), i32_arg(acc.size)])]


@lowers("global_norm", kernels=("tg_sumsq_list", "tg_global_norm"),
        scratch=_global_norm_scratch)
def _global_norm(node, at):
    """Partial sums of squares of every gradient into scratch, LIST_TENSORS gradients a
    launch (partial b of a launch: its block b); then one block adds them up in order."""
    launches, offset = [], 0
    grads = [((at.ptr(g),), g.size, 1.0) for g in node.srcs[:-1]]
    for table, nb in tensor_lists(grads, _sumsq_blocks):
        launches.append(Launch("tg_sumsq_list", (nb, 1, 1), [ptr_arg(at.scratch + 8 * offset),
                                                             table]))
        offset += nb
    launches.append(Launch("tg_global_norm", (1, 1, 1),
                           [ptr_arg(at.out), ptr_arg(at.scratch), i32_arg(offset),
                            ptr_arg(at.ptr(node.srcs[-1]))]))
    return launches


@lowers("adamw", kernels=("tg_adamw_list",), has_output=False)
def _adamw(node, at):
    """Every param's update, LIST_TENSORS params a launch."""
    groups, (hp, norm, div) = adamw_groups(node.srcs)
    tensors = [(tuple(at.ptr(t) for t in grp), grp[0].size, s)
               for grp, s in zip(groups, node.attrs["lr_scales"])]
    tail = [ptr_arg(at.ptr(hp)), ptr_arg(at.ptr(norm)), ptr_arg(at.ptr(div)),
            f64_arg(node.attrs["max_norm"])]
    return [Launch("tg_adamw_list", (nb, 1, 1), [table, *tail])
            for table, nb in tensor_lists(tensors, lambda n: grid_1d(n)[0])]
