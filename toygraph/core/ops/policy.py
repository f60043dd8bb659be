"""The ops a policy-gradient loss needs (GRPO and its variants; recipes/grpo.py): the
clipped surrogate of PPO/GRPO and the k3 estimate of the KL to a reference, each
elementwise, each differentiable in its first operand only (the old and the reference
log-probs are constants of the step, as TRL detaches them). Builders, shape rules,
backward rules, numpy kernels and CUDA lowering (policy.cu).

>>> loss = ops.clipped_surrogate(logp, old_logp, adv, eps_low=0.2, eps_high=0.28)  # doctest: +SKIP
>>> kl = ops.kl_penalty(logp, ref_logp)                                            # doctest: +SKIP
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import (Launch, declare_kernels, f32_arg, grid_1d, i32_arg, lowers,
                                    ptr_arg)

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "policy.cu")


def clipped_surrogate(logp, old, adv, eps_low: float, eps_high: float):
    """Per element ``-min(r * adv, clip(r, 1 - eps_low, 1 + eps_high) * adv)`` with the
    importance ratio ``r = exp(logp - old)`` (TRL's GRPO per-token loss). The gradient
    reaches ``logp`` only: ``-r * adv`` where the unclipped term is the minimum, 0 where
    the clipped one is (r above 1 + eps_high with adv > 0, below 1 - eps_low with adv < 0).
    ``old`` may be ``logp`` itself (one update per rollout: TRL's ``logp.detach()``)."""
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"clipped_surrogate needs 0 <= eps_low < 1 and eps_high >= 0, got "
                         f"{eps_low}, {eps_high}")
    return make_node("clipped_surrogate", [logp, old, adv], lo=float(1.0 - eps_low),
                     hi=float(1.0 + eps_high))


def kl_penalty(logp, ref):
    """Per element ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3 estimate of
    KL(policy || reference), as TRL's GRPO), written ``expm1(d) - d`` so small ``d`` keeps
    its digits. The gradient reaches ``logp`` only: ``1 - exp(ref - logp)``."""
    return make_node("kl_penalty", [logp, ref])


def _infer_same(n: int):
    def infer(shapes, dtypes, attrs):
        check_floats(dtypes)
        check(len(set(map(tuple, shapes))) == 1,
              f"the {n} operands must have one shape, got {[tuple(s) for s in shapes]}")
        return tuple(shapes[0]), F32
    return infer


define_op("clipped_surrogate", _infer_same(3), lambda n, g, need: [
    make_node("clipped_surrogate_back", [*n.srcs, g], **n.attrs), None, None])
define_op("clipped_surrogate_back", _infer_same(4))
define_op("kl_penalty", _infer_same(2), lambda n, g, need: [
    make_node("kl_penalty_back", [*n.srcs, g]), None])
define_op("kl_penalty_back", _infer_same(3))


# --- numpy kernels -----------------------------------------------------------------------------
def _ratio_and_clipped(logp, old, adv, lo, hi):
    r = np.exp(logp - old)
    return r, ((r > hi) & (adv > 0)) | ((r < lo) & (adv < 0))


@kernel("clipped_surrogate")
def _clipped_surrogate_numpy(out, srcs, attrs):
    logp, old, adv = srcs
    r = np.exp(logp - old)
    np.negative(np.minimum(r * adv, np.clip(r, attrs["lo"], attrs["hi"]) * adv), out=out)


@kernel("clipped_surrogate_back")
def _clipped_surrogate_back_numpy(out, srcs, attrs):
    logp, old, adv, g = srcs
    r, clipped = _ratio_and_clipped(logp, old, adv, attrs["lo"], attrs["hi"])
    out[...] = np.where(clipped, 0.0, -(r * adv) * g)


@kernel("kl_penalty")
def _kl_penalty_numpy(out, srcs, attrs):
    d = srcs[1] - srcs[0]
    out[...] = np.expm1(d) - d


@kernel("kl_penalty_back")
def _kl_penalty_back_numpy(out, srcs, attrs):
    logp, ref, g = srcs
    out[...] = -np.expm1(ref - logp) * g


# --- CUDA lowering (policy.cu) -----------------------------------------------------------------
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
