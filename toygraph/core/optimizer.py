"""AdamW and global-norm clipping inside the graph, the hp row, and LR schedules.

>>> step = build_training(loss_sum, params, count=n_valid, max_norm=1.0)   # doctest: +SKIP
>>> sess.upload(step.hp, hp_row(t=1, lr=1e-3))                             # doctest: +SKIP

The update is decoupled-decay AdamW, reading the hp row
``[lr, beta1, beta2, eps, weight_decay, 1/(1-beta1^t), 1/(1-beta2^t), t, micro]`` (t from 1;
t and the micro-batch index key the dropout masks, ops/stochastic/):
``m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;``
``w = w*(1 - lr*wd) - lr*(m*b1h) / (sqrt(v*b2h) + eps)``.

Gradients are accumulated as gradients of the *summed* loss together with the number of
counted tokens; the optimizer divides by that count. So k micro-batches give exactly the
gradient of one batch of all their tokens, however padding splits them. The global norm
is reduced on the device and the clip factor min(1, max_norm / norm) is applied inside the
update: no host round trip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, gradient_map
from toygraph.core.graph import Tensor
from toygraph.core.recompute import CheckpointReport, checkpoint_regions
from toygraph.errors import GraphError

#: Entries of the hp row: AdamW's seven, the optimizer step and the micro-batch index.
HP_SIZE = 9


@dataclass
class TrainingStep:
    """Handles to the tensors a caller uploads or downloads around a training step."""

    hp: Tensor                    # input [HP_SIZE]
    grad_norm: Tensor             # output of "step": global norm of the (averaged) gradient
    grads: dict[Tensor, Tensor]   # param -> accumulated gradient state
    moments: dict[Tensor, tuple[Tensor, Tensor]]
    count: Tensor                 # state: tokens accumulated since the last reset_grads
    checkpoint: CheckpointReport | None = None   # what activation checkpointing did, if on


def build_training(loss: Tensor, params: list[Tensor], *, count: Tensor | None = None,
                   max_norm: float = 0.0, checkpoint: bool = False,
                   ranks: int | None = None,
                   lr_scales: dict[Tensor, float] | None = None) -> TrainingStep:
    """Append backward, gradient accumulation, global norm and AdamW to loss's graph.

    ``loss`` is what gradients are taken of (a summed loss when ``count`` is given);
    ``count`` is the scalar number of items it summed over (e.g. ``count_valid(labels)``).
    ``max_norm`` > 0 clips the averaged gradient to that global norm. ``checkpoint``
    recomputes each region of the graph (decoder block) in the backward from its saved
    input instead of keeping its activations (recompute.py).
    ``max_norm`` > 0 clips the averaged gradient to that global norm. ``ranks`` (data
    parallelism) sums the accumulated gradients and the count over that many ranks with an
    ``all_reduce`` node between backward and the clip/AdamW nodes (ops/collective/).
    ``lr_scales`` gives some params a learning rate of lr * scale (LoRA+), a constant of
    the graph: the hp row stays the same for every param.
    """
    if max_norm < 0 or not math.isfinite(max_norm):
        raise GraphError(f"max_norm must be >= 0 and finite, got {max_norm}")
    graph = loss.graph
    first_backward = len(graph.nodes)
    all_grads = gradient_map(loss, params)
    grads = accumulate_grads({p: all_grads[p.id] for p in params})
    count_acc = graph.state("grad.count", (), kind="count")
    graph.effect(ops.accumulate(count_acc, count if count is not None else graph.scalar(1.0)),
                 "backward")
    report = checkpoint_regions(graph, first_backward, all_grads) if checkpoint else None
    divisor = count_acc
    if ranks is not None:  # clip and AdamW read its value, so they run after the reduction
        divisor = ops.all_reduce([count_acc, *grads.values()], ranks=ranks)
    hp = hp_input(graph)
    norm = graph.output(ops.global_norm(list(grads.values()), divisor), "step")
    moments = {}
    for p in params:
        moments[p] = (graph.state(f"adam_m.{p.name}", p.shape, kind="moment"),
                      graph.state(f"adam_v.{p.name}", p.shape, kind="moment"))
    # One adamw node for every param: CUDA updates them in a few multi-tensor launches.
    if params:
        graph.effect(ops.adamw(params, [grads[p] for p in params], [moments[p][0] for p in params],
                               [moments[p][1] for p in params], hp, norm, divisor,
                               max_norm=max_norm,
                               lr_scales=[(lr_scales or {}).get(p, 1.0) for p in params]),
                     "step")
    return TrainingStep(hp=hp, grad_norm=norm, grads=grads, moments=moments, count=count_acc,
                        checkpoint=report)


def hp_input(graph) -> Tensor:
    """The graph's hp row input, made on first use: the forward makes it when it has
    dropout (which reads the step from it), build_training otherwise."""
    for t in graph.nodes:
        if t.role == "input" and t.name == "hp":
            return t
    return graph.input("hp", (HP_SIZE,))


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW's per-run constants, which :func:`hp_row` writes into every step's row (the
    learning rate comes from the schedule)."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


def hp_row(t: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
           weight_decay: float = 0.0) -> np.ndarray:
    """The hp row for optimizer step ``t`` (counting from 1); its micro-batch entry is 0
    (Recipe.step sets it per micro-batch when the graph has dropout)."""
    if t < 1:
        raise GraphError(f"optimizer step t counts from 1, got {t}")
    for name, val, lo, hi in (("beta1", beta1, 0, 1), ("beta2", beta2, 0, 1)):
        if not lo <= val < hi:
            raise GraphError(f"{name} must be in [0, 1), got {val}")
    if t >= 1 << 24:   # it travels as an f32, exact up to 2^24
        raise GraphError(f"optimizer step t must be below 2^24, got {t}")
    return np.array([lr, beta1, beta2, eps, weight_decay,
                     1.0 / (1.0 - beta1 ** t), 1.0 / (1.0 - beta2 ** t), t, 0], np.float32)


@dataclass(frozen=True)
class Schedule:
    """Learning rate by optimizer step t (from 1).

    kind "constant": lr (after warmup); "linear": warmup then linear decay towards
    ``floor``; "cosine": warmup then cosine decay towards ``floor`` over ``total`` steps. Warmup ramps as
    lr * t / warmup for t <= warmup, so step 1 already moves the weights (never a zero-LR
    no-op) and step ``warmup`` reaches the full rate.
    """

    lr: float
    kind: str = "constant"
    warmup: int = 0
    total: int = 0
    floor: float = 0.0

    def __post_init__(self):
        if self.kind not in ("constant", "linear", "cosine"):
            raise GraphError(f"schedule must be constant, linear or cosine, got {self.kind!r}")
        if self.lr <= 0 or self.warmup < 0 or self.floor < 0:
            raise GraphError(f"schedule needs lr > 0, warmup >= 0, floor >= 0: {self}")
        if self.kind != "constant" and self.total <= self.warmup:
            raise GraphError(f"{self.kind} schedule needs total steps > warmup, got {self}")

    def __call__(self, t: int) -> float:
        if self.warmup and t <= self.warmup:
            return self.lr * t / self.warmup
        if self.kind == "constant":
            return self.lr
        # Progress 0 at the first step after warmup and (n-1)/n at the last, so the last
        # step still learns (a schedule that hits the floor at step ``total`` wastes it
        # when the floor is 0).
        frac = min(1.0, (t - self.warmup - 1) / (self.total - self.warmup))
        if self.kind == "linear":
            return self.floor + (self.lr - self.floor) * (1.0 - frac)
        return self.floor + (self.lr - self.floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
