"""The CUDA lowering of the preference family (kernels in preference.cu; its ops and their rules
are in __init__.py)."""
from __future__ import annotations

from toygraph.ops.elementwise.cuda import pointwise
from toygraph.ops.lowering import Launch, declare_kernels, i32_arg, lowers, ptr_arg, rows_grid

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "preference.cu")


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
    its numpy kernel (tests/cuda/test_cuda_registry.py)."""
    return pointwise(node, at)


lowers("softplus", kernels=("tg_softplus",))(_pointwise)
lowers("softplus_back", kernels=("tg_softplus_back",))(_pointwise)
lowers("log1mexp", kernels=("tg_log1mexp",))(_pointwise)
lowers("log1mexp_back", kernels=("tg_log1mexp_back",))(_pointwise)
