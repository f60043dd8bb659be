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
    slot where the file has them."""
    N = x.shape[0]
    ids, w = route(cfg, linear(x, prefix + "ffn_gate_inp.weight"))
    routes = ops.group_by_expert(ids, cfg.n_expert)

    def experts(h, proj):
        y = ops.expert_matmul(h, W[f"{prefix}{proj}.weight"], routes)
        bias = W.get(f"{prefix}{proj}.bias")
        return y if bias is None else y + ops.get_rows(bias, ids)

    h = activation(experts(x, "ffn_gate_exps"), experts(x, "ffn_up_exps"))
    y = experts(h, "ffn_down_exps")                           # [N, k, n_embd]
    return ops.sum(y * w.reshape(N, cfg.n_expert_used, 1), 1)
