"""The ops a policy-gradient loss needs (GRPO and its variants; recipes/grpo.py): the
clipped surrogate of PPO/GRPO and the k3 estimate of the KL to a reference, each
elementwise, each differentiable in its first operand only (the old and the reference
log-probs are constants of the step, as TRL detaches them). Builders, shape rules,
backward rules, numpy kernels and CUDA lowering (policy.cu).

>>> loss = ops.clipped_surrogate(logp, old_logp, adv, eps_low=0.2, eps_high=0.28)  # doctest: +SKIP
>>> kl = ops.kl_penalty(logp, ref_logp)                                            # doctest: +SKIP
"""
from __future__ import annotations

from toygraph.ops.table import F32, check, check_floats, define_op, make_node


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
