"""CUDA lowering of the preference-loss ops (pref.cu; ops_pref.py): per-token log-probs
over logit rows and their backward, softplus and log1mexp and theirs."""
from __future__ import annotations

from .launch import Launch, _blocks, _rows_grid, i32, p
from .registry import lowers


@lowers("token_logprobs", kernels=("tg_token_logprobs",))
def _token_logprobs(node, at):
    logits, labels = node.srcs
    N, V = logits.shape
    return [Launch("tg_token_logprobs", _rows_grid(N),
                   [p(at.out), p(at.ptr(logits)), p(at.ptr(labels)), i32(N), i32(V)])]


@lowers("token_logprobs_back", kernels=("tg_token_logprobs_back",))
def _token_logprobs_back(node, at):
    logits, labels, g = node.srcs
    N, V = logits.shape
    return [Launch("tg_token_logprobs_back", _rows_grid(N),
                   [p(at.out), p(at.ptr(logits)), p(at.ptr(labels)), p(at.ptr(g)), i32(N),
                    i32(V)])]


def _pointwise(node, at):
    """out[i] = kernel(x[i]) or, for the backward ops, kernel(x[i], g[i])."""
    kernel = "tg_" + node.op
    srcs = [p(at.ptr(s)) for s in node.srcs]
    return [Launch(kernel, _blocks(node.size), [p(at.out), *srcs, i32(node.size)])]


lowers("softplus", kernels=("tg_softplus",))(_pointwise)
lowers("softplus_back", kernels=("tg_softplus_back",))(_pointwise)
lowers("log1mexp", kernels=("tg_log1mexp",))(_pointwise)
lowers("log1mexp_back", kernels=("tg_log1mexp_back",))(_pointwise)
