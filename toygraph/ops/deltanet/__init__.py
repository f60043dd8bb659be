"""The Gated DeltaNet ops (Qwen3.5's linear-attention layers): the causal depthwise conv1d
over the q/k/v projections, and the gated delta rule. Builders, shape rules, backward rules,
numpy kernels and CUDA lowering (deltanet.cu).

The gated delta rule, per head, with a state S [dk, dv] starting at 0 (or a given state):

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - a_t S_{t-1}^T k_t),   a_t = exp(g_t)
    o_t = S_t^T q_t

(transformers' torch_recurrent_gated_delta_rule; q and k arrive L2-normalised, q scaled).
The numpy forward computes it chunk by chunk in the WY form (transformers'
torch_chunk_gated_delta_rule: a unit lower-triangular system per chunk turns the chunk's
delta updates into matmuls, then one state update per chunk); the backward keeps the state
at each chunk start and differentiates each chunk's matmuls in closed form, from the last
chunk, carrying the gradient of the state. The CUDA kernels (deltanet.cu) compute the same chunked form, forward
and backward (the backward in closed form per chunk, from the chunk-start states), one block
per (batch, head); decoding one token from a state runs a step-wise kernel instead.
"""
from __future__ import annotations

import numpy as np

from toygraph.errors import GraphError
from toygraph.ops.shape import unpack
from toygraph.ops.table import F32, check, check_floats, define_op, make_node

#: Time steps per chunk of the WY forward (transformers' and FLA's default).
CHUNK = 64


# --- causal depthwise conv1d -------------------------------------------------------------------
def causal_conv1d(x, w):
    """y[b, t, c] = sum_j w[c, j] x[b, t - K + 1 + j, c] (zeros before t = 0): a depthwise
    convolution over time of x [B, T, C] with the kernel w [C, K], seeing no future step."""
    return make_node("causal_conv1d", [x, w])


def _infer_conv(shapes, dtypes, attrs):
    check_floats(dtypes)
    (xs, ws) = shapes
    check(len(xs) == 3 and len(ws) == 2 and ws[0] == xs[2],
          f"x must be [B, T, C] and w [C, K], got {xs} and {ws}")
    return tuple(xs), F32


def _infer_conv_back(shapes, dtypes, attrs):
    (xs, ws, gs) = shapes
    check(tuple(gs) == tuple(xs), f"the gradient must be {xs}, got {gs}")
    return (int(np.prod(xs)) + int(np.prod(ws)),), F32


def _grad_conv(n, g, need):
    x, w = n.srcs
    back = make_node("causal_conv1d_back", [x, w, g])
    return [unpack(back, 0, x.shape) if need[0] else None,
            unpack(back, x.size, w.shape) if need[1] else None]


define_op("causal_conv1d", _infer_conv, _grad_conv)
define_op("causal_conv1d_back", _infer_conv_back)


# --- the gated delta rule ----------------------------------------------------------------------
def delta_rule(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """The gated delta rule over q, k [B, T, H, dk], v [B, T, H, dv], the log decays g and
    the write strengths beta [B, T, H]: o [B, T, H, dv].

    With ``state`` [B, H, dk, dv] (generation: the state after the tokens before these),
    returns (o, the state after the last token); no gradient flows then.
    """
    srcs = [q, k, v, g, beta] + ([] if state is None else [state])
    node = make_node("delta_rule", srcs, chunk=int(chunk))
    if state is None:
        return node
    B, T, H, dv = v.shape
    return unpack(node, 0, (B, T, H, dv)), unpack(node, B * T * H * dv, state.shape)


def _infer_delta(shapes, dtypes, attrs):
    check_floats(dtypes)
    qs, ks, vs, gs, bs = (tuple(s) for s in shapes[:5])
    check(len(qs) == 4 and qs == ks and len(vs) == 4 and vs[:3] == qs[:3],
          f"q, k must be [B, T, H, dk] and v [B, T, H, dv], got {qs}, {ks}, {vs}")
    check(gs == qs[:3] and bs == qs[:3], f"g and beta must be {list(qs[:3])}, got {gs} and {bs}")
    check(attrs["chunk"] >= 1, f"chunk must be >= 1, got {attrs['chunk']}")
    B, T, H, dk = qs
    if len(shapes) == 6:
        check(tuple(shapes[5]) == (B, H, dk, vs[3]),
              f"state must be {[B, H, dk, vs[3]]}, got {list(shapes[5])}")
        return (B * T * H * vs[3] + B * H * dk * vs[3],), F32
    return vs, F32


def _infer_delta_back(shapes, dtypes, attrs):
    _infer_delta(shapes[:5], dtypes[:5], attrs)
    check(tuple(shapes[5]) == tuple(shapes[2]), f"the gradient must be {shapes[2]}, got {shapes[5]}")
    return (sum(int(np.prod(s)) for s in shapes[:5]),), F32


def _grad_delta(n, gout, need):
    if len(n.srcs) == 6:
        raise GraphError("delta_rule with a given state (generation) has no gradient")
    back = make_node("delta_rule_back", [*n.srcs, gout], chunk=n.attrs["chunk"])
    grads, offset = [], 0
    for src, wanted in zip(n.srcs, need):
        grads.append(unpack(back, offset, src.shape) if wanted else None)
        offset += src.size
    return grads


define_op("delta_rule", _infer_delta, _grad_delta)
define_op("delta_rule_back", _infer_delta_back)
