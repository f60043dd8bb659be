"""The ops preference losses need (DPO, ORPO; recipes/dpo.py): per-token log-probs of the
labels (token_logprobs), softplus (and so log_sigmoid) and log1mexp, each in its
numerically stable form. Builders, shape rules, backward rules, numpy kernels and CUDA
lowering (preference.cu).
"""
from __future__ import annotations

from toygraph.ops.elementwise import infer_same2, infer_unary
from toygraph.ops.table import F32, I32, LABELS, check, define_op, make_node


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
