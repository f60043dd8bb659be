"""The CUDA lowering of the policy family (kernels in policy.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.ops.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                   ptr_arg)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "policy.cu")


@lowers("clipped_surrogate", kernels=("tg_clipped_surrogate",))
@lowers("clipped_surrogate_back", kernels=("tg_clipped_surrogate_back",))
def _clipped_surrogate(node, at):
    (name,) = at.kernels
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    return [Launch(name, grid_1d(node.size), [ptr_arg(at.out), *srcs, i32_arg(node.size),
                                              f32_arg(node.attrs["lo"]),
                                              f32_arg(node.attrs["hi"])])]


@lowers("kl_penalty", kernels=("tg_kl_penalty",))
@lowers("kl_penalty_back", kernels=("tg_kl_penalty_back",))
def _kl_penalty(node, at):
    (name,) = at.kernels
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    return [Launch(name, grid_1d(node.size), [ptr_arg(at.out), *srcs, i32_arg(node.size)])]
