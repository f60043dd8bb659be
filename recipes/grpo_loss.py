"""GRPO's objective, with TRL's semantics: group-relative advantages (on the host) and the
clipped-surrogate loss with its variants (in the graph).

>>> adv, degenerate = group_advantages(rewards, group=8, scale="group")     # doctest: +SKIP
>>> loss, parts = build_objective(g, logp, old, ref, Objective(loss_type="dapo"))  # doctest: +SKIP
>>> parts.upload(sess, mask, adv)                                           # doctest: +SKIP

Each completion r has per-token log-probs ``logp[r, t]`` of its tokens (t < its length,
``mask[r, t]`` = 1) and an advantage ``A[r]``. With ``ratio = exp(logp - old)`` (token
level) or ``exp(mean_t(logp - old))`` per row (sequence level, GSPO), the per-token loss
is ``-min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A) + kl_beta * kl`` (kl: the k3
estimate to the reference), and the loss types differ only in how the tokens are summed:

- ``grpo``: the mean over each completion's tokens, then over the completions;
- ``bnpo``: the sum over every token of the batch / the number of those tokens;
- ``dapo``: the same here (TRL divides by the tokens of the whole generation batch,
  across accumulation steps and processes: one micro-batch per step, one process);
- ``dr_grpo``: the sum / (completions x max_completion_length).

Those sums are weights ``w[r, t]`` derived from the mask on the host and uploaded with the
advantages each step (:meth:`ObjectiveInputs.upload`), so one graph serves every batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from toygraph import ops
from toygraph.errors import GraphError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING = ("token", "sequence")
#: Added to the standard deviation the advantages are divided by (TRL's 1e-4).
STD_EPS = 1e-4


@dataclass(frozen=True)
class Objective:
    """The options of the loss (TRL's names and defaults; ``epsilon_high`` None = ``epsilon``)."""
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    importance_sampling: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    kl_beta: float = 0.0
    max_completion_length: int = 256

    def __post_init__(self):
        for name, allowed in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                              ("importance_sampling", IMPORTANCE_SAMPLING)):
            if getattr(self, name) not in allowed:
                raise GraphError(f"{name} must be one of {', '.join(allowed)}, got "
                                 f"{getattr(self, name)!r}")
        if not 0 <= self.epsilon < 1:
            raise GraphError(f"epsilon must be in [0, 1), got {self.epsilon}")
        if not (self.eps_high >= 0 and math.isfinite(self.eps_high)):
            raise GraphError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise GraphError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.max_completion_length < 1:
            raise GraphError(f"max_completion_length must be >= 1, got {self.max_completion_length}")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# --- advantages (host) ---------------------------------------------------------------------------
def _nanmean(x: np.ndarray, axis=None) -> np.ndarray:
    """The mean ignoring NaN; NaN where there is no value."""
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    total = np.nansum(x, axis=axis, keepdims=True)
    return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """The unbiased standard deviation ignoring NaN (TRL's nanstd); NaN with < 2 values."""
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    sq = np.nansum((x - _nanmean(x, axis)) ** 2, axis=axis, keepdims=True)
    return np.where(n > 1, np.sqrt(sq / np.maximum(n - 1, 1)), np.nan)


def group_advantages(rewards, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [R], degenerate [R / group]) of the rewards [R] of R / group prompts'
    ``group`` consecutive completions each: reward - its group's mean, divided by the
    group's (``scale="group"``) or the batch's (``"batch"``) standard deviation + 1e-4, or
    not divided (``"none"``). A NaN reward (no reward function applied) is left out of the
    means and the deviations and gets advantage 0. A degenerate group (its rewards all
    equal) gets advantage 0 in every mode (reward - mean is 0) and is counted."""
    if scale not in SCALE_REWARDS:
        raise GraphError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale!r}")
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or group < 1 or len(r) % group:
        raise GraphError(f"{r.shape} rewards do not make groups of {group}")
    grouped = r.reshape(-1, group)
    group_std = _nanstd(grouped, axis=1)                      # [n, 1]
    adv = grouped - _nanmean(grouped, axis=1)
    if scale == "group":
        adv = adv / (group_std + STD_EPS)
    elif scale == "batch":
        adv = adv / (_nanstd(r) + STD_EPS)
    degenerate = np.isclose(np.nan_to_num(group_std[:, 0], nan=0.0), 0.0, rtol=1e-5, atol=1e-8)
    return np.nan_to_num(adv.reshape(-1), nan=0.0), degenerate


def token_weights(mask, loss_type: str, max_completion_length: int) -> np.ndarray:
    """w [R, C] with loss = sum(w * per-token loss) for ``loss_type`` (module docstring)."""
    m = np.asarray(mask, np.float64)
    rows = m.shape[0]
    if loss_type == "grpo":
        return m / np.maximum(m.sum(axis=1, keepdims=True), 1.0) / rows
    if loss_type in ("bnpo", "dapo"):
        return m / max(m.sum(), 1.0)
    if loss_type == "dr_grpo":
        return m / (rows * max_completion_length)
    raise GraphError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def clipped(ratio, adv, objective: Objective) -> np.ndarray:
    """Where the clipped term is the minimum (TRL's clip_ratio/region: low with A < 0,
    high with A > 0)."""
    ratio, adv = np.asarray(ratio), np.asarray(adv)
    return (((ratio < 1 - objective.epsilon) & (adv < 0))
            | ((ratio > 1 + objective.eps_high) & (adv > 0)))


# --- the loss (graph) ----------------------------------------------------------------------------
@dataclass
class ObjectiveInputs:
    """The inputs :func:`build_objective` adds, uploaded each step from the mask and the
    advantages."""
    objective: Objective
    advantages: object         # [R, 1]
    token_weights: object | None = None     # [R, C] (token level, or the KL term)
    sequence_mean: object | None = None     # [R, C] mask / length (sequence level)
    sequence_weights: object | None = None  # [R, 1] row sums of token_weights (sequence level)

    def upload(self, sess, mask, advantages) -> None:
        o = self.objective
        m = np.asarray(mask, np.float64)
        w = token_weights(m, o.loss_type, o.max_completion_length)
        f = np.float32
        sess.upload(self.advantages, np.asarray(advantages, np.float64)[:, None].astype(f))
        if self.token_weights is not None:
            sess.upload(self.token_weights, w.astype(f))
        if self.sequence_mean is not None:
            sess.upload(self.sequence_mean,
                        (m / np.maximum(m.sum(axis=1, keepdims=True), 1.0)).astype(f))
            sess.upload(self.sequence_weights, w.sum(axis=1, keepdims=True).astype(f))


def build_objective(g, logp, old, ref, objective: Objective, prefix: str = "grpo."):
    """The loss of ``logp`` [R, C] (a graph tensor, 0 off the mask), ``old`` (the log-probs
    the completions were sampled under: an input, or ``logp`` itself for one update per
    rollout, as TRL's ``logp.detach()``) and ``ref`` (the reference's, or None when
    ``kl_beta`` is 0). Returns (loss, ObjectiveInputs, per-token kl or None)."""
    o = objective
    R, C = logp.shape
    inputs = ObjectiveInputs(o, g.input(prefix + "advantages", (R, 1)))
    if o.importance_sampling == "token" or o.kl_beta:
        inputs.token_weights = g.input(prefix + "token_weights", (R, C))
    if o.importance_sampling == "token":
        lp, lo = logp, old
        adv, weights = ops.expand(inputs.advantages, (R, C)), inputs.token_weights
    else:  # GSPO: one ratio per completion, from the mean of its tokens' log-ratios
        inputs.sequence_mean = g.input(prefix + "sequence_mean", (R, C))
        inputs.sequence_weights = g.input(prefix + "sequence_weights", (R, 1))
        lp = ops.sum(ops.mul(logp, inputs.sequence_mean), axis=1).reshape(R, 1)
        lo = lp if old is logp else ops.sum(ops.mul(old, inputs.sequence_mean), axis=1).reshape(R, 1)
        adv, weights = inputs.advantages, inputs.sequence_weights
    per = ops.clipped_surrogate(lp, lo, adv, o.epsilon, o.eps_high)
    loss = ops.sum(ops.mul(per, weights))
    kl = None
    if o.kl_beta:
        if ref is None:
            raise GraphError("kl_beta > 0 needs the reference's log-probs")
        kl = ops.kl_penalty(logp, ref)
        loss = ops.add(loss, ops.scale(ops.sum(ops.mul(kl, inputs.token_weights)), o.kl_beta))
    return loss, inputs, kl
