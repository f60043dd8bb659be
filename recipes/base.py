"""The recipe object: build the training graph once (realize), then one call per step.

>>> recipe = LoRA(targets=("q", "v"), rank=8, alpha=16)
>>> recipe.realize(model, model.config, RecipeOptions(seq_len=128, batch=4, seed=42))
>>> loss = recipe.step(token_ids, positions, labels, hp_row(t, lr), is_first=(t == 1))  # [1, 4, 128] each

The caller owns the GGUF handle, the model config and the per-step inputs, as in the reference
recipe over ggml: ``realize`` builds frozen base + trainable weights + loss + backward +
clip + AdamW and realizes the session; ``step`` resets (first step) or resets grads,
uploads token ids, positions, labels and the hp row, replays the graph, and downloads
the loss.

A recipe is one module that registers its class (registry.py) and owns what differs
between recipes: which weights train (``weight_mode``, ``lora_config``), its loss (the
:meth:`Recipe.build_loss` hook of the one ``realize``), its data (:meth:`Recipe.load_data`,
:meth:`Recipe.encode_data`, :meth:`Recipe.make_batches`), what a micro-batch uploads and
yields (:meth:`Recipe.upload`, :meth:`Recipe.collect`, :meth:`Recipe.finish_step`) and its
metrics (``last_metrics``, :meth:`Recipe.metrics_text`). The training loop and the
command line only ever go through these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from toygraph import ops
from toygraph.core.frozen_base import MODES as BASE_MEMORY_MODES
from toygraph.distributed import world
from toygraph.core.graph import Graph
from toygraph.ops.stochastic import HP_MICRO
from toygraph.recipes.options import PackingOptions
from toygraph.core.optimizer import build_training
from toygraph.precision import BACKENDS, precision_error
from toygraph.core.session import Session
from toygraph.data.batches import encode_dataset
from toygraph.data.examples import load_examples
from toygraph.data.packing import (batches_per_epoch, epoch_batches, labelled_share,
                                   packing_efficiency)
from toygraph.errors import GraphError
from toygraph.models.decoder import (BuildOptions, LoraConfig, WeightSource, build_decoder,
                                     fused_head_loss, lm_head)

#: Whether the CPU backend always uses the fused head + loss. On CUDA the fused op is always
#: used: it never holds [tokens, vocab] logits (SmolLM2 at batch 4 x seq 2048: GiBs). On
#: the CPU it computes on the labelled rows only (ops/loss/cpu.h), where the unfused head
#: multiplies every row twice (forward and input gradient); its backward recomputes the
#: logits of every chunk of 128 rows but the first, which the forward hands it. So the CPU
#: fuses where the data labels few of the slots (FUSED_HEAD_CPU_SHARE or less: chat and
#: instruction data, whose prompts carry no label) and where the logits and their gradient
#: would take FUSED_HEAD_CPU_BYTES or more (a 151,936-token vocabulary at 4 x 512 tokens,
#: 2.5 GB, where a QLoRA step's base is a few hundred MB). Measured on the engine replay
#: (2-vCPU AMD EPYC Zen 5, 2 threads, SmolLM2 Q4_1, the demo's LoRA r16 on 7 targets,
#: 2 x 140 tokens; the two agree to rounding, tests/ops/test_ops_loss.py): every slot
#: labelled, fused 574-648 ms a step against 625-631 unfused (bench_lora.py, three
#: alternations: even); the demo's data, 24% of the slots labelled, fused 545 against 581
#: unfused before the handoff (40 demo steps, events.jsonl's wall_ms) and the handoff
#: 0.93 of that (bench/engine_ab.py).
FUSED_HEAD_ON_CPU = False
FUSED_HEAD_CPU_SHARE = 0.4
FUSED_HEAD_CPU_BYTES = 256 << 20


def fused_head(backend: str, model_cfg=None, rows: int | None = None,
               labelled_share: float | None = None) -> bool:
    """Whether the head and the loss run as one fused op: on CUDA, and on the CPU where
    ``rows`` rows of logits and their gradient would take FUSED_HEAD_CPU_BYTES, or the data
    labels at most FUSED_HEAD_CPU_SHARE of the slots (``labelled_share``, None: unknown), or
    FUSED_HEAD_ON_CPU; unless the model soft-caps its logits (Gemma 4), which the fused op
    does not do."""
    if model_cfg is not None and getattr(model_cfg, "logit_softcap", 0.0):
        return False
    if backend == "cuda" or FUSED_HEAD_ON_CPU:
        return True
    if labelled_share is not None and labelled_share <= FUSED_HEAD_CPU_SHARE:
        return True
    return (rows is not None and model_cfg is not None
            and 2 * 4 * rows * model_cfg.n_vocab >= FUSED_HEAD_CPU_BYTES)


def head_loss(net, labels, fused: bool):
    """The summed cross-entropy of the model's next-token logits against ``labels``, the
    head fused with the loss or not (fused_head decides)."""
    if fused:
        return fused_head_loss(net, net.hidden, labels, "sum")
    return ops.cross_entropy(lm_head(net), labels, reduction="sum")


def _with_micro(hp, i: int) -> np.ndarray:
    """The hp row with micro-batch index i (ops/stochastic/ keys dropout by it)."""
    row = np.array(hp, np.float32)
    row[HP_MICRO] = i
    return row


@dataclass(frozen=True)
class RecipeOptions:
    """Options every recipe shares. ``untied``/``qkv_bias`` default to the model's own
    values; set them to assert what the model must have. ``clip`` 0 turns clipping
    off; ``grad_accum`` micro-batches of ``batch`` sequences make one optimizer step.
    ``precision`` is the matmuls' input precision (toygraph.precision.PRECISIONS). The seed
    and init scale default to LoraConfig's: defaults live once, in the lowest layer.
    ``data_parallel`` makes this process one rank of ``toygraph.distributed.world()``:
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
    base_memory: str | None = None   # numpy backend: a block-format base decoded or kept
    #                                  quantized (core/frozen_base.py); None: $TOYGRAPH_BASE_MEMORY
    labelled_share: float | None = None   # the data's labelled share of the slots
    #                                       (Recipe.labelled_share; None: unknown), fused_head's

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
        if self.base_memory is not None and self.base_memory not in BASE_MEMORY_MODES:
            raise GraphError(f"RecipeOptions.base_memory must be one of "
                             f"{', '.join(BASE_MEMORY_MODES)}, got {self.base_memory!r}")

    @classmethod
    def names(cls):
        return [f.name for f in fields(cls)]


class Recipe:
    """Shared realize/step machinery; a subclass chooses which weights train and, through
    the hooks below, its loss, data and metrics."""

    name = ""                 # the registered name (--recipe), set by registry.register
    summary = ""              # what trains, in a few words (the --recipe help)
    weight_mode = "frozen"    # "frozen" (LoRA), "finetune" or "scratch" (every weight trains)
    trains_adapter = False    # True: the result is a LoRA adapter on the frozen base
    eval_unit = "tokens"      # what evaluate() counts: "tokens" (per-token loss) or "pairs"
    Options = PackingOptions  # the run options it takes besides every run's (options.py)
    last_metrics: dict = {}   # metrics of the last step or evaluation besides the loss

    @classmethod
    def from_options(cls, cfg) -> "Recipe":
        """The recipe a run configuration (toygraph.training.RunConfig) asks for."""
        return cls()

    # --- data ------------------------------------------------------------------------------
    @staticmethod
    def load_data(path) -> list:
        """The data file's rows (file:line errors): instruction, chat or text examples."""
        return load_examples(path)

    @staticmethod
    def encode_data(rows: list, tok, seq_len: int, progress=None):
        """The rows tokenized into training items (an EncodedDataset with its report);
        ``progress(done, total)`` is told as it goes."""
        return encode_dataset(rows, tok, seq_len, progress)

    def make_batches(self, items, batch: int, seq_len: int, pad: int, *, shuffle: bool,
                     seed: int, epoch: int) -> list:
        """The epoch's batches of encoded items, in the layout ``step`` takes (packed rows
        when ``opts.pack``)."""
        return epoch_batches(items, batch, seq_len, pad, pack=self.opts.pack, shuffle=shuffle,
                             seed=seed, epoch=epoch)

    def batches_per_epoch(self, items, batch: int, seq_len: int) -> int:
        """How many batches :meth:`make_batches` gives per epoch (the same every epoch)."""
        return batches_per_epoch(items, batch, seq_len, self.opts.pack)

    @staticmethod
    def packing_report(items, batch: int, seq_len: int) -> dict | None:
        """Real tokens per slot with and without packing (None: the recipe never packs)."""
        return packing_efficiency(items, batch, seq_len)

    def labelled_share(self, items, batch: int, seq_len: int, pack: bool) -> float | None:
        """The share of an epoch's row slots that carry a label (None: not counted), which
        decides whether the CPU fuses the head with the loss (fused_head)."""
        return labelled_share(items, batch, seq_len, pack)

    @classmethod
    def reference_adapter_dir(cls, cfg) -> str | None:
        """The adapter directory a frozen reference model of the run includes (whose content
        a resumed run must keep), or None."""
        return None

    # --- the graph -------------------------------------------------------------------------
    def lora_config(self, opts: RecipeOptions) -> LoraConfig | None:
        return None

    def lr_scales(self) -> dict:
        """Params whose learning rate is lr * scale (LoRA+), after build_graph."""
        return {}

    @staticmethod
    def check_model(model_cfg, opts: RecipeOptions) -> None:
        """The options that assert what the model must have (untied, qkv_bias)."""
        if opts.untied is not None and opts.untied == model_cfg.tied_output:
            raise GraphError(f"options say untied={opts.untied} but the model's output head is "
                             f"{'tied' if model_cfg.tied_output else 'untied'}")
        if opts.qkv_bias is not None and opts.qkv_bias != model_cfg.qkv_bias:
            raise GraphError(f"options say qkv_bias={opts.qkv_bias} but the model has "
                             f"{'a' if model_cfg.qkv_bias else 'no'} qkv bias")

    def check_options(self, opts: RecipeOptions) -> None:
        """Options this recipe cannot honour, refused before anything is built."""

    def rows_per_batch(self, opts: RecipeOptions) -> int:
        """Sequences in one micro-batch of ``opts.batch``."""
        return opts.batch

    def build_graph(self, gguf, model_cfg, opts: RecipeOptions) -> Graph:
        """The forward pass and the loss (:meth:`build_loss`), without the optimizer."""
        self.check_model(model_cfg, opts)
        self.check_options(opts)
        self.opts, self.model_cfg = opts, model_cfg
        self.graph = g = Graph()
        R, T = self.rows_per_batch(opts), opts.seq_len
        source = WeightSource(gguf, self.weight_mode, seed=opts.seed)
        self.net = build_decoder(g, model_cfg, source, batch=R, seq_len=T,
                                 lora=self.lora_config(opts),
                                 options=BuildOptions(logits=False, packed=opts.pack))
        self.labels = g.input("labels", (R * T,), "i32")
        self.loss, self.count = self.build_loss(g, opts)
        return g

    def build_loss(self, g: Graph, opts: RecipeOptions):
        """The loss hook: (the loss the gradients are of, the target count it is divided by
        or None). Here one cross-entropy serves both: its sum drives the gradients
        (token-weighted accumulation) and sum / count is the reported mean loss."""
        self.head_fused = fused_head(opts.backend, self.net.cfg, self.net.hidden.shape[0],
                                     opts.labelled_share)
        self.loss_sum = g.output(head_loss(self.net, self.labels, self.head_fused))
        return self.loss_sum, g.output(ops.count_valid(self.labels))

    def realize(self, gguf, model_cfg, opts: RecipeOptions) -> None:
        """Build the graph (forward, loss, backward, clip, AdamW) and realize its session."""
        self.build_graph(gguf, model_cfg, opts)
        self.world = world() if opts.data_parallel else None
        self.train = build_training(self.loss, self.net.params, count=self.count,
                                    max_norm=opts.clip,
                                    checkpoint=opts.checkpoint_activations,
                                    ranks=self.world.size if self.world else None,
                                    lr_scales=self.lr_scales())
        self.sess = Session(self.graph, backend=opts.backend, precision=opts.precision,
                            base_memory=opts.base_memory)
        self.sess.realize()
        # LoRA dropout: its masks are keyed by the hp row's step and micro-batch entries
        self.has_dropout = any(t.op == "dropout" for t in self.graph.nodes)
        self.step_index = 0
        self.last_metrics = {}

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

    def upload(self, ids, pos, lab, seg=None):
        """Upload one micro-batch (and whatever the recipe derives from it)."""
        s = self.sess
        s.upload(self.net.tokens, ids)
        s.upload(self.net.positions, pos)
        s.upload(self.labels, np.asarray(lab).reshape(-1))
        if self.net.segments is not None:
            if seg is None:
                raise GraphError("evaluate: a packing recipe needs the batch's segment ids")
            s.upload(self.net.segments, seg)

    def collect(self, sums: dict) -> None:
        """After a micro-batch ran: add what it yields to the step's ``sums``."""
        sums["loss"] = sums.get("loss", 0.0) + float(self.sess.download(self.loss_sum))
        sums["count"] = sums.get("count", 0.0) + float(self.sess.download(self.count))

    def finish_step(self, sums: dict) -> float:
        """The step's reported loss from its micro-batches' ``sums``: the token-weighted
        mean (the job's, summed over the ranks, when data parallel)."""
        total, count = sums["loss"], sums["count"]
        if self.world is not None:  # the job's loss: every rank's sums added up
            total, count = map(float, self.world.sum([total, count]))
        return total / count if count else 0.0

    def load_adapter_init(self, values: dict[str, np.ndarray]) -> None:
        """Start from an adapter's values (``--adapter-init``)."""
        self.load_trainable(values)

    def step(self, token_ids, positions, labels, hp, is_first: bool, segments=None) -> float:
        """One optimizer step; returns the loss of the forward pass before the update.

        The arrays are [grad_accum, batch, seq_len] (one micro-batch axis, k = 1 without
        accumulation); the loss is the recipe's reduction over all k micro-batches (the
        token-weighted mean here). ``segments`` (same shape) are packed rows' segment ids,
        given iff ``opts.pack``.
        """
        s = self.sess
        if is_first:
            s.reset()
        else:
            s.reset_grads()
        micro = self._micro_batches(token_ids, positions, labels, segments)
        s.upload(self.train.hp, hp)
        sums: dict = {}
        for i, m in enumerate(micro):
            if self.has_dropout and i:   # each micro-batch its own dropout masks
                s.upload(self.train.hp, _with_micro(hp, i))
            self.upload(*m)
            s.run("step" if i == len(micro) - 1 else "backward")
            self.collect(sums)
        self.step_index += 1
        return self.finish_step(sums)

    def evaluate(self, token_ids, positions, labels, segments=None) -> tuple[float, int]:
        """Forward only: (summed loss, counted tokens) of one batch [batch, seq_len]
        (``segments`` for a packing recipe)."""
        if getattr(self, "has_dropout", False):   # step 0 in the hp row: no dropout
            self.sess.upload(self.train.hp, np.zeros(self.train.hp.shape, np.float32))
        self.upload(token_ids, positions, labels, segments)
        self.sess.run("forward")
        return float(self.sess.download(self.loss_sum)), int(self.sess.download(self.count))

    @staticmethod
    def metrics_text(metrics: dict) -> str:
        """The recipe's metrics as they ride on the progress line ("" for none)."""
        return ""

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
