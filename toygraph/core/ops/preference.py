"""The ops preference losses need (DPO, ORPO; recipes/dpo.py): per-token log-probs of the
labels (token_logprobs), softplus (and so log_sigmoid) and log1mexp, each in its
numerically stable form. Builders, shape rules, backward rules, numpy kernels and CUDA
lowering (preference.cu).
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.elementwise import infer_same2, infer_unary, pointwise
from toygraph.core.ops.table import F32, I32, LABELS, check, define_op, kernel, make_node
from toygraph.cuda.lowering import Launch, declare_kernels, i32_arg, lowers, ptr_arg, rows_grid

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "preference.cu")


# --- per-token log-probabilities ----------------------------------------------------------
def token_logprobs(logits, labels):
    """log_softmax(logits)[i, labels[i]] for each row i of logits [N, vocab]; 0 where the
    label is -1 (ignored). Summing a sequence's rows gives its log-likelihood."""
    return make_node("token_logprobs", [logits, labels])


def _infer_token_logprobs(shapes, dtypes, attrs):
    check(dtypes == [F32, I32], "token_logprobs needs f32 logits and i32 labels")
    check(len(shapes[0]) == 2 and tuple(shapes[1]) == shapes[0][:1],
          f"logits must be [N, vocab] and labels [N], got {shapes[0]} and {shapes[1]}")
    return shapes[0][:1], F32


def _infer_token_logprobs_back(shapes, dtypes, attrs):
    _infer_token_logprobs(shapes[:2], dtypes[:2], attrs)
    check(dtypes[2] == F32 and tuple(shapes[2]) == shapes[0][:1],
          f"the gradient must be f32 [{shapes[0][0]}], got {dtypes[2]} {shapes[2]}")
    return shapes[0], F32


define_op("token_logprobs", _infer_token_logprobs, lambda n, g, need: [
    make_node("token_logprobs_back", [n.srcs[0], n.srcs[1], g]), None],
    id_ranges=lambda n: {1: (-1, n.srcs[0].shape[1], LABELS)})
# d/dlogits = g[i] * (onehot(label) - softmax(logits[i])), 0 on ignored rows.
define_op("token_logprobs_back", _infer_token_logprobs_back)


# --- softplus, log-sigmoid, log1mexp ---------------------------------------------------------
def softplus(x):
    """log(1 + exp(x)), as max(x, 0) + log1p(exp(-|x|)) so it never overflows."""
    return make_node("softplus", [x])


def log_sigmoid(x):
    """log(sigmoid(x)) = -softplus(-x)."""
    return make_node("scale", [softplus(make_node("scale", [x], s=-1.0))], s=-1.0)


def log1mexp(x):
    """log(1 - exp(x)) for x <= 0: log(-expm1(x)) near 0, log1p(-exp(x)) below -ln 2
    (Maechler's split, accurate on both sides). ORPO's log-odds use it."""
    return make_node("log1mexp", [x])


define_op("softplus", infer_unary,
          lambda n, g, need: [make_node("softplus_back", [n.srcs[0], g])])
define_op("softplus_back", infer_same2)           # g * sigmoid(x)
define_op("log1mexp", infer_unary,
          lambda n, g, need: [make_node("log1mexp_back", [n.srcs[0], g])])
define_op("log1mexp_back", infer_same2)           # g * -1 / expm1(-x)


# --- numpy kernels -----------------------------------------------------------------------------
#: Logit rows handled at once, so no [N, vocab] temporary beside the logits themselves.
_ROWS = 256


def _log_softmax_rows(logits, start, stop):
    z = logits[start:stop] - logits[start:stop].max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    return z


@kernel("token_logprobs")
def _token_logprobs_numpy(out, srcs, attrs):
    logits, labels = srcs
    out[...] = 0
    for start in range(0, len(labels), _ROWS):
        stop = min(start + _ROWS, len(labels))
        lab = labels[start:stop]
        rows = np.nonzero(lab >= 0)[0]
        if len(rows):
            z = _log_softmax_rows(logits, start, stop)
            out[start + rows] = z[rows, lab[rows]]


@kernel("token_logprobs_back")
def _token_logprobs_back_numpy(out, srcs, attrs):
    logits, labels, g = srcs
    for start in range(0, len(labels), _ROWS):
        stop = min(start + _ROWS, len(labels))
        lab = labels[start:stop]
        valid = lab >= 0
        o = out[start:stop]
        np.exp(_log_softmax_rows(logits, start, stop), out=o)
        np.negative(o, out=o)                         # -softmax
        rows = np.nonzero(valid)[0]
        o[rows, lab[rows]] += 1.0                     # onehot - softmax
        o *= (valid * g[start:stop])[:, None].astype(o.dtype)


@kernel("softplus")
def _softplus_numpy(out, srcs, attrs):
    x = srcs[0]
    np.log1p(np.exp(-np.abs(x)), out=out)
    out += np.maximum(x, 0)


@kernel("softplus_back")
def _softplus_back_numpy(out, srcs, attrs):
    x, g = srcs
    # sigmoid(x) from exp(-|x|), which never overflows: e/(1+e) below 0, 1/(1+e) above.
    e = np.exp(-np.abs(x))
    np.divide(np.where(x >= 0, 1.0, e), 1.0 + e, out=out)
    out *= g


@kernel("log1mexp")
def _log1mexp_numpy(out, srcs, attrs):
    x = srcs[0]
    near = x > -np.log(2.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # x = 0: -inf, x > 0: nan, as log(1-e^x)
        out[...] = np.where(near, np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


@kernel("log1mexp_back")
def _log1mexp_back_numpy(out, srcs, attrs):
    x, g = srcs
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(-g, np.expm1(-x), out=out)


# --- CUDA lowering (preference.cu) -------------------------------------------------------------
@lowers("token_logprobs", kernels=("tg_token_logprobs",))
def _token_logprobs(node, at):
    logits, labels = node.srcs
    N, V = logits.shape
    return [Launch("tg_token_logprobs", rows_grid(N),
                   [ptr_arg(at.out), ptr_arg(at.ptr(logits)), ptr_arg(at.ptr(labels)), i32_arg(N),
                    i32_arg(V)])]


@lowers("token_logprobs_back", kernels=("tg_token_logprobs_back",))
def _token_logprobs_back(node, at):
    logits, labels, g = node.srcs
    N, V = logits.shape
    return [Launch("tg_token_logprobs_back", rows_grid(N),
                   [ptr_arg(at.out), ptr_arg(at.ptr(logits)), ptr_arg(at.ptr(labels)),
                    ptr_arg(at.ptr(g)), i32_arg(N), i32_arg(V)])]


def _pointwise(node, at):
    """out[i] = kernel(x[i]) or, for the backward ops, kernel(x[i], g[i]): elementwise's
    launch under a name of this module, where every op's lowering must be defined beside
    its numpy kernel (tests/test_cuda_registry.py)."""
    return pointwise(node, at)


lowers("softplus", kernels=("tg_softplus",))(_pointwise)
lowers("softplus_back", kernels=("tg_softplus_back",))(_pointwise)
lowers("log1mexp", kernels=("tg_log1mexp",))(_pointwise)
lowers("log1mexp_back", kernels=("tg_log1mexp_back",))(_pointwise)
