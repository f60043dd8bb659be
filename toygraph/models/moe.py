"""The mixture-of-experts FFN of a decoder layer, as graph ops (toygraph/ops/experts/).

For N tokens x [N, n_embd], E experts, k chosen per token (llama.cpp's build_moe_ffn,
transformers' Qwen3MoeSparseMoeBlock / GptOssMLP)::

    logits = x @ ffn_gate_inp^T (+ ffn_gate_inp.bias)             [N, E]
    "softmax_topk": p = softmax(logits); ids = topk(p, k); w = p[ids] (/ sum when normed)
    "topk_softmax": ids = topk(logits, k); w = softmax(logits[ids])
    w = w * expert_weights_scale
    f[n] = sum_j w[n, j] * down_e(act(gate_e(x[n]), up_e(x[n])))   e = ids[n, j]
    [f[n] += sigmoid(x[n] . ffn_gate_inp_shexp) * shared(x[n])]   (Qwen2-MoE's shared expert)

Renormalised softmax-then-top-k weights are the softmax of the chosen logits (the
unchosen experts' terms cancel), so that case is built as "topk_softmax" on the
probabilities' order. Each expert's GEMM runs over only the tokens that chose it.
"""
from __future__ import annotations

from toygraph import ops
from toygraph.models.ffn import ACTIVATIONS, dense_ffn
from toygraph.models.parts import Experts


def route(part: Experts, logits):
    """(ids [N, k] i32, weights [N, k]) of the part's router on ``logits`` [N, E]."""
    k = part.used
    if part.router == "softmax_topk":
        probs = ops.softmax(logits)
        ids = ops.topk(probs, k)   # on the probabilities, as both references choose
        w = ops.softmax(ops.take_along(logits, ids)) if part.norm_weights \
            else ops.take_along(probs, ids)
    elif part.router == "topk_softmax":
        ids = ops.topk(logits, k)
        w = ops.softmax(ops.take_along(logits, ids))
    else:
        raise ValueError(f"unknown router {part.router!r}")
    if part.weights_scale != 1.0:
        w = ops.scale(w, part.weights_scale)
    return ids, w


def moe_ffn(b, part: Experts, x):
    """The MoE FFN of layer b.i on x [N, n_embd]; ``b.proj(x, name)`` is the decoder's
    projection (bias and LoRA included; b: the layer's models/decoder.Block). Expert
    biases ``ffn_*_exps.bias`` [E, out] are added per slot where the part has them.

    Expert LoRA (``b.expert_adapter(name)`` gives (A [E, r, n_in], B [E, n_out, r],
    scaling) or None): each slot adds ``scaling * B[e] A[e] h`` for its own expert e, two
    grouped GEMMs over the same routes, so an expert's adapter sees only its tokens. The
    gate and up experts share one adapter (decoder.EXPERT_TARGETS), its B's rows the
    gate's then the up's."""
    N, act = x.shape[0], ACTIVATIONS[part.activation]
    ids, w = route(part, b.proj(x, "ffn_gate_inp"))
    routes = ops.group_by_expert(ids, part.count)

    def low_rank(h, name):
        found = b.expert_adapter(name)
        if found is None:
            return None
        a, lora_b, scaling = found
        return ops.scale(ops.expert_matmul(ops.expert_matmul(h, a, routes), lora_b, routes),
                         scaling)

    def experts(h, proj, delta=None):
        y = ops.expert_matmul(h, b.w(f"{proj}.weight"), routes)
        if delta is not None:
            y = y + delta
        bias = b.get(f"{proj}.bias")
        return y if bias is None else y + ops.get_rows(bias, ids)

    gate_up, f = low_rank(x, "ffn_gate_up_exps"), part.width   # [N, k, 2 * width]
    gate_delta, up_delta = ((None, None) if gate_up is None else
                            (ops.narrow(gate_up, 0, f), ops.narrow(gate_up, f, f)))
    h = act(experts(x, "ffn_gate_exps", gate_delta), experts(x, "ffn_up_exps", up_delta))
    y = experts(h, "ffn_down_exps", low_rank(h, "ffn_down_exps"))   # [N, k, n_embd]
    out = ops.sum(y * w.reshape(N, part.used, 1), 1)
    if part.shared is not None:   # gated per token by sigmoid(x . ffn_gate_inp_shexp)
        gate = ops.sigmoid(b.proj(x, "ffn_gate_inp_shexp"))   # [N, 1]
        out = out + dense_ffn(b, part.shared, x) * gate
    return out
