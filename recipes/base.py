"""The recipe object: build the training graph once (realize), then one call per step.

>>> recipe = LoRA(targets=("q", "v"), rank=8, alpha=16)
>>> recipe.realize(model, model.config, RecipeOptions(seq_len=128, batch=4, seed=42))
>>> loss = recipe.step(token_ids, positions, labels, hp_row(t, lr), is_first=(t == 1))  # [1, 4, 128] each

The caller owns the GGUF handle, the model config and the per-step inputs, as in the reference
recipe over ggml: ``realize`` builds frozen base + trainable weights + loss + backward +
clip + AdamW and realizes the session; ``step`` resets (first step) or resets grads,
uploads token ids, positions, labels and the hp row, replays the graph, and downloads
the loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from toygraph.core import ops
from toygraph.core.distributed import world
from toygraph.core.graph import Graph
from toygraph.core.optimizer import build_training
from toygraph.core.precision import BACKENDS, precision_error
from toygraph.core.session import Session
from toygraph.data.packing import batches_per_epoch, epoch_batches
from toygraph.errors import GraphError
from toygraph.models.decoder import LoraConfig, build_decoder, lm_head

#: used: it never holds [tokens, vocab] logits (SmolLM2 at batch 4 x seq 2048: GiBs). On
#: the CPU memory is rarely the limit and the fused backward recomputes the head matmul,
#: which made a SmolLM2 LoRA step (batch 8 x seq 64, 2 cores) slower: 2.91 s against
#: 2.67 s unfused. So the CPU keeps the unfused head; the two agree to rounding
#: (tests/test_ops.py, tests/test_llama.py).
FUSED_HEAD_ON_CPU = False


def fused_head(backend: str) -> bool:
    return backend == "cuda" or FUSED_HEAD_ON_CPU


def head_loss(net, labels, backend: str):
    """The summed cross-entropy of the model's next-token logits against ``labels``."""
    if fused_head(backend):
        return ops.linear_cross_entropy(net.hidden, net.head, labels, reduction="sum")
    return ops.cross_entropy(lm_head(net), labels, reduction="sum")


@dataclass(frozen=True)
class RecipeOptions:
    """Options every recipe shares. ``untied``/``qkv_bias`` default to the model's own
    values; set them to assert what the model must have. ``clip`` 0 turns clipping
    off; ``grad_accum`` micro-batches of ``batch`` sequences make one optimizer step.
    ``precision`` is the matmuls' input precision (toygraph.core.precision.PRECISIONS). The seed
    and init scale default to LoraConfig's: defaults live once, in the lowest layer.
    ``data_parallel`` makes this process one rank of ``toygraph.core.distributed.world()``:
    ``batch`` is then its share of the batch, gradients and token counts are summed over
    the ranks inside the graph and the reported loss is the job's."""

    seq_len: int = 128
    batch: int = 4
    seed: int = LoraConfig.seed
    init_scale: float = LoraConfig.init_scale
    precision: str = "f32"
    untied: bool | None = None
    qkv_bias: bool | None = None
    clip: float = 1.0
    grad_accum: int = 1
    backend: str = "cpu"
    checkpoint_activations: bool = False   # recompute each block in the backward (recompute.py)
    data_parallel: bool = False
    pack: bool = False      # packed rows: step/evaluate take segment ids (toygraph.data.packing)

    def __post_init__(self):
        for name in ("seq_len", "batch", "grad_accum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise GraphError(f"RecipeOptions.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (self.init_scale >= 0 and math.isfinite(self.init_scale)):
            raise GraphError(f"RecipeOptions.init_scale must be >= 0, got {self.init_scale}")
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise GraphError(f"RecipeOptions.clip must be >= 0 (0 = off), got {self.clip}")
        if self.backend not in BACKENDS:
            raise GraphError(f"RecipeOptions.backend must be cpu or cuda, got {self.backend!r}")
        why = precision_error(self.precision, self.backend)
        if why:
            raise GraphError(f"RecipeOptions.precision {why}")

    @classmethod
    def names(cls):
        return [f.name for f in fields(cls)]


class Recipe:
    """Shared realize/step machinery; subclasses choose which weights train."""

    weight_mode = "frozen"
    def make_batches(self, items, batch: int, seq_len: int, pad: int, *, shuffle: bool,
                     seed: int, epoch: int) -> list:
        """The epoch's batches of encoded items, in the layout ``step`` takes (packed rows
        when ``opts.pack``)."""
        return epoch_batches(items, batch, seq_len, pad, pack=self.opts.pack, shuffle=shuffle,
                             seed=seed, epoch=epoch)

    def batches_per_epoch(self, items, batch: int, seq_len: int) -> int:
        """How many batches :meth:`make_batches` gives per epoch (the same every epoch)."""
        return batches_per_epoch(items, batch, seq_len, self.opts.pack)

    def lora_config(self, opts: RecipeOptions) -> LoraConfig | None:
        return None

    @staticmethod
    def check_model(model_cfg, opts: RecipeOptions) -> None:
        """The options that assert what the model must have (untied, qkv_bias)."""
        if opts.untied is not None and opts.untied == model_cfg.tied_output:
            raise GraphError(f"options say untied={opts.untied} but the model's output head is "
                             f"{'tied' if model_cfg.tied_output else 'untied'}")
        if opts.qkv_bias is not None and opts.qkv_bias != model_cfg.qkv_bias:
            raise GraphError(f"options say qkv_bias={opts.qkv_bias} but the model has "
                             f"{'a' if model_cfg.qkv_bias else 'no'} qkv bias")

    def realize(self, gguf, model_cfg, opts: RecipeOptions) -> None:
        self.check_model(model_cfg, opts)
        self.opts, self.model_cfg = opts, model_cfg
        g = Graph()
        B, T = opts.batch, opts.seq_len
        self.net = build_decoder(g, model_cfg, batch=B, seq_len=T, model=gguf, weights=self.weight_mode,
                                 lora=self.lora_config(opts), seed=opts.seed, logits=False,
                                 packed=opts.pack)
        self.labels = g.input("labels", (B * T,), "i32")
        # One cross-entropy serves both: its sum drives the gradients (token-weighted
        # accumulation) and sum / count is the reported mean loss.
        self.loss_sum = g.output(head_loss(self.net, self.labels, opts.backend))
        self.count = g.output(ops.count_valid(self.labels))
        self.world = world() if opts.data_parallel else None
        self.train = build_training(self.loss_sum, self.net.params, count=self.count,
                                    max_norm=opts.clip,
                                    checkpoint=opts.checkpoint_activations,
                                    ranks=self.world.size if self.world else None)
        self.graph = g
        self.sess = Session(g, backend=opts.backend, precision=opts.precision)
        self.sess.realize()
        self.step_index = 0

    # --- per step -------------------------------------------------------------------------
    def batch_rows(self) -> tuple[int, str]:
        """The number of sequences in a micro-batch, and its description for errors."""
        return self.opts.batch, "batch"

    def _micro_batches(self, token_ids, positions, labels, segments):
        """Check the step inputs: each is [grad_accum, batch, seq_len], whatever k is;
        segment ids are given exactly when the recipe packs."""
        if (segments is not None) != self.opts.pack:
            raise GraphError("step: segment ids are needed exactly when RecipeOptions.pack is "
                             f"set (pack={self.opts.pack}, segments "
                             f"{'given' if segments is not None else 'missing'})")
        rows, what = self.batch_rows()
        shape = (self.opts.grad_accum, rows, self.opts.seq_len)
        names = ("token_ids", "positions", "labels", "segments")
        arrays = [np.asarray(a) for a in (token_ids, positions, labels, segments)
                  if a is not None]
        for name, a in zip(names, arrays):
            if a.shape != shape:
                raise GraphError(f"step: {name} must have shape [grad_accum, {what}, seq_len] "
                                 f"= {shape}, got {a.shape}")
        return [m + (None,) * (4 - len(m)) for m in zip(*arrays)]

    def _upload(self, ids, pos, lab, seg=None):
        s = self.sess
        s.upload(self.net.tokens, ids)
        s.upload(self.net.positions, pos)
        s.upload(self.labels, np.asarray(lab).reshape(-1))
        if self.net.segments is not None:
            if seg is None:
                raise GraphError("evaluate: a packing recipe needs the batch's segment ids")
            s.upload(self.net.segments, seg)

    def _begin_step(self, token_ids, positions, labels, hp, is_first: bool,
                    segments=None) -> list:
        """Reset (first step) or reset grads, upload the hp row; the checked micro-batches."""
        if is_first:
            self.sess.reset()
        else:
            self.sess.reset_grads()
        micro = self._micro_batches(token_ids, positions, labels, segments)
        self.sess.upload(self.train.hp, hp)
        return micro

    def load_adapter_init(self, values: dict[str, np.ndarray]) -> None:
        """Start from an adapter's values (``--adapter-init``)."""
        self.load_trainable(values)

    def step(self, token_ids, positions, labels, hp, is_first: bool, segments=None) -> float:
        """One optimizer step; returns the mean loss of the forward pass before the update.

        The arrays are [grad_accum, batch, seq_len] (one micro-batch axis, k = 1 without
        accumulation); the loss is the token-weighted mean over all k micro-batches.
        ``segments`` (same shape) are packed rows' segment ids, given iff ``opts.pack``.
        """
        s = self.sess
        micro = self._begin_step(token_ids, positions, labels, hp, is_first, segments)
        total, count = 0.0, 0.0
        for i, (ids, pos, lab, seg) in enumerate(micro):
            self._upload(ids, pos, lab, seg)
            s.run("step" if i == len(micro) - 1 else "backward")
            total += float(s.download(self.loss_sum))
            count += float(s.download(self.count))
        if self.world is not None:  # the job's loss: every rank's sums added up
            total, count = map(float, self.world.sum([total, count]))
        self.step_index += 1
        return total / count if count else 0.0

    def evaluate(self, token_ids, positions, labels, segments=None) -> tuple[float, int]:
        """Forward only: (summed loss, counted tokens) of one batch [batch, seq_len]
        (``segments`` for a packing recipe)."""
        self._upload(token_ids, positions, labels, segments)
        self.sess.run("forward")
        return float(self.sess.download(self.loss_sum)), int(self.sess.download(self.count))

    def last_grad_norm(self) -> float:
        return float(self.sess.download(self.train.grad_norm))

    # --- weights and optimizer state --------------------------------------------------------
    def trainable(self) -> dict[str, np.ndarray]:
        """Current values of every trainable tensor, by name."""
        return {p.name: self.sess.download(p) for p in self.net.params}

    def load_trainable(self, values: dict[str, np.ndarray]) -> None:
        by_name = {p.name: p for p in self.net.params}
        unknown = sorted(set(values) - set(by_name))
        if unknown:
            raise GraphError(f"load_trainable: no trainable tensors named {unknown[:5]}")
        for name, v in values.items():
            self.sess.load_param(by_name[name], v)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        out = {}
        for p, (m, v) in self.train.moments.items():
            out[f"adam_m.{p.name}"] = self.sess.download(m)
            out[f"adam_v.{p.name}"] = self.sess.download(v)
        return out

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        for p, (m, v) in self.train.moments.items():
            for t in (m, v):
                if t.name not in state:
                    raise GraphError(f"optimizer state lacks {t.name!r}")
                self.sess.load_param(t, state[t.name])
