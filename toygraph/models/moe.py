"""The mixture-of-experts FFN of a decoder layer, as graph ops (toygraph/core/ops/experts.py).

For N tokens x [N, n_embd], E experts, k chosen per token (llama.cpp's build_moe_ffn,
transformers' Qwen3MoeSparseMoeBlock / GptOssMLP)::

    logits = x @ ffn_gate_inp^T (+ ffn_gate_inp.bias)             [N, E]
    "softmax_topk": p = softmax(logits); ids = topk(p, k); w = p[ids] (/ sum when normed)
    "topk_softmax": ids = topk(logits, k); w = softmax(logits[ids])
    w = w * expert_weights_scale
    f[n] = sum_j w[n, j] * down_e(act(gate_e(x[n]), up_e(x[n])))   e = ids[n, j]

Renormalised softmax-then-top-k weights are the softmax of the chosen logits (the
unchosen experts' terms cancel), so that case is built as "topk_softmax" on the
probabilities' order. Each expert's GEMM runs over only the tokens that chose it.
"""
from __future__ import annotations

from toygraph.core import ops


def route(cfg, logits):
    """(ids [N, k] i32, weights [N, k]) of the family's router on ``logits`` [N, E]."""
    fam, k = cfg.family, cfg.n_expert_used
    if fam.router == "softmax_topk":
        probs = ops.softmax(logits)
        ids = ops.topk(probs, k)   # on the probabilities, as both references choose
        w = ops.softmax(ops.take_along(logits, ids)) if cfg.expert_weights_norm \
            else ops.take_along(probs, ids)
    elif fam.router == "topk_softmax":
        ids = ops.topk(logits, k)
        w = ops.softmax(ops.take_along(logits, ids))
    else:
        raise ValueError(f"unknown router {fam.router!r}")
    if cfg.expert_weights_scale != 1.0:
        w = ops.scale(w, cfg.expert_weights_scale)
    return ids, w


def moe_ffn(cfg, W, prefix: str, x, linear, activation):
    """The MoE FFN of layer ``prefix`` ("blk.N.") on x [N, n_embd]; ``linear(x, name)`` is
    the decoder's projection (bias and LoRA included), ``activation(gate, up)`` the
    family's gated activation. Expert biases ``ffn_*_exps.bias`` [E, out] are added per
    slot where the file has them.

    Expert LoRA (``linear.expert_adapter(name)`` gives (A [E, r, n_in], B [E, n_out, r],
    scaling) or None): each slot adds ``scaling * B[e] A[e] h`` for its own expert e, two
    grouped GEMMs over the same routes, so an expert's adapter sees only its tokens. The
    gate and up experts share one adapter (decoder.EXPERT_TARGETS), its B's rows the
    gate's then the up's."""
    N = x.shape[0]
    ids, w = route(cfg, linear(x, prefix + "ffn_gate_inp.weight"))
    routes = ops.group_by_expert(ids, cfg.n_expert)
    adapter = getattr(linear, "expert_adapter", lambda name: None)

    def low_rank(h, name):
        found = adapter(f"{prefix}{name}.weight")
        if found is None:
            return None
        a, b, scaling = found
        return ops.scale(ops.expert_matmul(ops.expert_matmul(h, a, routes), b, routes), scaling)

    def experts(h, proj, delta=None):
        y = ops.expert_matmul(h, W[f"{prefix}{proj}.weight"], routes)
        if delta is not None:
            y = y + delta
        bias = W.get(f"{prefix}{proj}.bias")
        return y if bias is None else y + ops.get_rows(bias, ids)

    gate_up, f = low_rank(x, "ffn_gate_up_exps"), cfg.n_ff_exp   # [N, k, 2 * n_ff_exp]
    gate_delta, up_delta = ((None, None) if gate_up is None else
                            (ops.narrow(gate_up, 0, f), ops.narrow(gate_up, f, f)))
    h = activation(experts(x, "ffn_gate_exps", gate_delta), experts(x, "ffn_up_exps", up_delta))
    y = experts(h, "ffn_down_exps", low_rank(h, "ffn_down_exps"))   # [N, k, n_embd]
    return ops.sum(y * w.reshape(N, cfg.n_expert_used, 1), 1)
