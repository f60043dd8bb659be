"""The divergence guard: stop a run whose loss or weights have blown up.

Two checks, both on values the loop already has on the host (no extra device sync):
- every step, the loss and the gradient norm (downloaded for the step event) must be
  finite, and the loss must stay below ``loss_factor`` x the running median of the recent
  losses or within ``MIN_RISE`` nats of it (a ratio alone misfires near zero: once a run
  has memorized most of its data the median is ~0.03 and one batch holding a fact not yet
  learned costs 0.3, ten times more, while a real blow-up climbs by nats toward ln(vocab));
- before any checkpoint is written, the weights and AdamW moments being saved (downloaded
  for the file anyway) must be finite, and the weights' norm must not jump beyond
  ``norm_factor`` x that of the last state that passed (a runaway update can leave a
  finite loss but destroyed weights, e.g. ``--lr 1e10``).
A state that fails is never saved, never marked best; the run ends ``diverged``.
"""
from __future__ import annotations

import math

import numpy as np

from toygraph.errors import ToygraphError


class Diverged(ToygraphError):
    """The run diverged; the message says what was seen and what to change."""


def weights_norm(weights: dict) -> float:
    return math.sqrt(sum(float(np.dot(a.ravel().astype(np.float64), a.ravel().astype(np.float64)))
                         for a in weights.values()))


class DivergenceGuard:
    """Keeps its memory (recent losses, last good norm) in the run's ``LoopState``, so a
    resumed run guards exactly as the uninterrupted one would."""
    WINDOW = 50          # losses in the running median
    WARMUP = 5           # steps before the median check starts
    NORM_FACTOR = 100.0  # a weights' norm jump beyond this factor is a runaway update
    MIN_RISE = 1.0       # nats above the median a loss must also be to count as diverged

    def __init__(self, state, loss_factor: float = 10.0):
        self.state, self.loss_factor = state, loss_factor

    def check_step(self, step: int, loss: float, grad_norm: float):
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            raise Diverged(f"step {step}: loss {loss}, gradient norm {grad_norm}; "
                           f"lower --lr or set --clip")
        recent = self.state.recent_losses
        if self.loss_factor and len(recent) >= self.WARMUP:
            median = float(np.median(recent))
            if median > 0 and loss > max(self.loss_factor * median, median + self.MIN_RISE):
                raise Diverged(f"step {step}: loss {loss:.4g} is above {self.loss_factor:g} x the "
                               f"running median {median:.4g} (and {self.MIN_RISE:g} above it); "
                               f"lower --lr (or raise --diverge-factor)")
        recent.append(loss)
        del recent[:-self.WINDOW]

    def check_state(self, step: int, weights: dict, moments: dict):
        """Raise Diverged if the state about to be saved is not sound; else remember its norm."""
        for kind, arrays in (("weight", weights), ("optimizer moment", moments)):
            for name, a in arrays.items():
                if not np.isfinite(a).all():
                    raise Diverged(f"step {step}: {kind} {name} holds non-finite values; "
                                   f"lower --lr or set --clip")
        norm, good = weights_norm(weights), self.state.good_norm
        if good is not None and norm > self.NORM_FACTOR * max(good, 1.0):
            raise Diverged(f"step {step}: the weights' norm jumped to {norm:.4g} from "
                           f"{good:.4g} at the last good state; lower --lr")
        self.state.good_norm = norm

    def reference(self, weights: dict):
        """Record the starting weights' norm (before the first step)."""
        self.state.good_norm = weights_norm(weights)
