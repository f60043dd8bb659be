"""The one training loop: a ``Trainer`` over a recipe, with an explicit loop state.

>>> trainer = Trainer(recipe, micro_batch, Schedule(1e-3, "cosine", total=100), total=100)  # doctest: +SKIP
>>> losses = trainer.run()                                                                   # doctest: +SKIP

The CLI (``toygraph finetune``), the Python API (``run_training``) and the golden
experiments all step through ``Trainer.run``. Everything a run needs to continue lives
in ``LoopState`` (serialised into each checkpoint's ``state.json``); the data order is a
function of (seed, epoch), so the step number is enough to regenerate the batches that
follow. What happens around the steps (evaluation, checkpoints, events, signals) is a
``Hooks`` object's business, so the loop itself stays a dozen lines.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from toygraph.core.optimizer import AdamWSettings, hp_row


@dataclass
class LoopState:
    """The serialisable state of a run between two steps."""
    step: int = 0                       # optimizer steps done
    epoch: int = 0                      # epoch of the next micro-batch
    best_val: float | None = None       # lowest validation loss so far
    bad_evals: int = 0                  # evaluations since the last improvement
    data_hash: str | None = None        # sha256 of the data file
    reference_hash: str | None = None   # DPO: sha256 of the --adapter-init reference adapter
    options: dict = field(default_factory=dict)          # every option of the run
    model_fingerprint: dict | None = None                # resume.model_fingerprint
    model_identity: dict | None = None                   # resume.model_identity
    # running, interrupted, ..., or finishing: the training ended (``outcome``: completed or
    # early_stopped) and the run's result at the top of its directory is being written. A
    # checkpoint never says "completed": only the top level, written after it, does.
    status: str = "running"
    reason: str | None = None           # why a run that did not complete ended
    recent_losses: list = field(default_factory=list)    # divergence guard's window
    good_norm: float | None = None      # weights' norm at the last state that passed the guard
    run_id: str | None = None           # the run's id (lineage.py); None before runs had one
    outcome: str | None = None          # finishing: the status the run ends with
    eval_step: int | None = None        # the step of the last evaluation (None: none yet)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict, where: str = "state.json") -> "LoopState":
        """The state a checkpoint's ``state.json`` holds, each field checked: a count that
        is missing or not a count is an error naming it, never a silent restart at 0."""
        from toygraph.errors import DataError
        if not isinstance(doc, dict) or "step" not in doc:
            raise DataError(f"{where}: no step recorded; not a checkpoint's state")
        for name in ("step", "epoch", "bad_evals", "eval_step"):
            value = doc.get(name, 0)
            if value is not None and (type(value) is not int or value < 0):
                raise DataError(f"{where}: {name} must be a count (an integer >= 0), got {value!r}")
        for name in ("best_val", "good_norm"):
            value = doc.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise DataError(f"{where}: {name} must be a finite number or null, got {value!r}")
        if not isinstance(doc.get("options", {}), dict) or not isinstance(doc.get("recent_losses", []), list):
            raise DataError(f"{where}: options must be a mapping and recent_losses a list")
        return cls(**{f.name: doc[f.name] for f in fields(cls) if f.name in doc})


class Hooks:
    """What happens around the steps; the base does nothing (the golden experiments)."""

    def before_step(self, trainer: "Trainer"):
        pass

    def after_step(self, trainer: "Trainer", loss: float, micro: list, wall_s: float) -> bool:
        """Called after every step; returning True ends the loop."""
        return False


def shard(rows: np.ndarray, rank: int, ranks: int, axis: int = 1) -> np.ndarray:
    """Rank ``rank``'s contiguous share of ``rows`` along ``axis`` (the batch rows), which
    must divide evenly; the whole array with one rank."""
    if ranks == 1:
        return rows
    n = rows.shape[axis]
    if n % ranks:
        raise ValueError(f"{n} rows do not divide over {ranks} ranks")
    per = n // ranks
    return np.take(rows, range(rank * per, (rank + 1) * per), axis=axis)


class Trainer:
    """Steps ``recipe`` from ``state.step`` to ``total``.

    ``micro_batch(m)`` returns micro-batch ``m`` (counting across epochs) as an object with
    ``tokens``, ``positions``, ``labels`` ([batch, seq_len] each); step t uses micro-batches
    (t-1)*k .. t*k-1 for k = the recipe's ``grad_accum``. ``micro_per_epoch`` (when known)
    keeps ``state.epoch`` current. ``resumed`` says the recipe's weights and moments came
    from a checkpoint, so the first step must not reset the moments. With ``ranks`` > 1
    (data parallelism) the micro-batches are the job's and this process steps on rows
    ``rank * batch .. (rank + 1) * batch - 1`` of each: its shard (``shard``).
    """

    def __init__(self, recipe, micro_batch, schedule, total: int, *, adamw: AdamWSettings = AdamWSettings(),
                 state: LoopState | None = None, resumed: bool = False,
                 micro_per_epoch: int | None = None, rank: int = 0, ranks: int = 1):
        self.recipe, self.micro_batch, self.schedule = recipe, micro_batch, schedule
        self.total, self.adamw = total, adamw
        self.state = state or LoopState()
        self.resumed, self.micro_per_epoch = resumed, micro_per_epoch
        self.grad_accum = recipe.opts.grad_accum
        self.rank, self.ranks = rank, ranks
        self.last_lr = None

    def inputs(self, t: int):
        """(micro-batches, tokens, positions, labels, segments) of step t; arrays
        [grad_accum, batch, seq_len] (this rank's shard of the job's micro-batches, which the
        hooks get whole), segments None unless the batches are packed."""
        micro = [self.micro_batch((t - 1) * self.grad_accum + j) for j in range(self.grad_accum)]
        fields = ("tokens", "positions", "labels") + (("segments",) if micro[0].segments is not None else ())
        stack = [shard(np.stack([getattr(b, f) for b in micro]), self.rank, self.ranks)
                 for f in fields]
        return (micro, *stack, None) if len(stack) == 3 else (micro, *stack)

    def step(self) -> tuple[float, list]:
        """One optimizer step; returns (loss before the update, its micro-batches)."""
        t = self.state.step + 1
        micro, tokens, positions, labels, segments = self.inputs(t)
        self.last_lr = lr = self.schedule(t)
        hp = hp_row(t, lr, self.adamw.beta1, self.adamw.beta2, self.adamw.eps,
                    self.adamw.weight_decay)
        loss = self.recipe.step(tokens, positions, labels, hp, is_first=(t == 1 and not self.resumed),
                                segments=segments)
        self.state.step = t
        if self.micro_per_epoch:
            self.state.epoch = t * self.grad_accum // self.micro_per_epoch
        return loss, micro

    def run(self, hooks: Hooks | None = None) -> list[float]:
        """Step until ``total`` or until a hook says stop; returns this call's losses."""
        hooks = hooks or Hooks()
        losses = []
        while self.state.step < self.total:
            hooks.before_step(self)
            t0 = time.perf_counter()
            loss, micro = self.step()
            losses.append(loss)
            if hooks.after_step(self, loss, micro, time.perf_counter() - t0):
                break
        return losses
