"""Preference tuning with LoRA: DPO and ORPO, each one realized graph replayed per step.

>>> recipe = DPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1)
>>> recipe.realize(model, model.config, RecipeOptions(seq_len=128, batch=2))   # doctest: +SKIP
>>> loss = recipe.step(tokens, positions, labels, hp, is_first=True)          # doctest: +SKIP
>>> recipe.last_metrics["rewards/margin"]                                       # doctest: +SKIP

A micro-batch of ``batch`` pairs is ``2 * batch`` rows: the chosen sequences first,
then the rejected ones in the same order (toygraph.data.preference.pair_batches builds them).
Labels mark the response tokens only (-1 elsewhere); a sequence's log-probability is the
sum of its labels' log-probs.

DPO's reference model is the frozen base with the adapter switched off: a second forward
pass in the same graph, reading the same const (memory-mapped) base tensors, so the base
is held once. Started from an adapter (``--adapter-init``), the reference is base + that
adapter, frozen: a second set of adapter tensors that no gradient reaches.

The losses follow TRL (the DPO and ORPO papers' formulas): DPO's sigmoid loss with label
smoothing, ``-logsigmoid(b l) (1 - ls) - logsigmoid(-b l) ls`` with
``l = (pi_c - pi_r) - (ref_c - ref_r)``, rewards ``b (pi - ref)``; ORPO's
``nll(chosen) - b logsigmoid(log_odds)`` on the responses' mean per-token log-probs,
``log_odds = (lc - lr) - (log(1 - e^lc) - log(1 - e^lr))``. Both average over the pairs
of a micro-batch; k accumulated micro-batches average their losses (as TRL does).
"""
from __future__ import annotations

import math

import numpy as np

from toygraph.core import ops
from toygraph.core.graph import Graph
from toygraph.core.optimizer import build_training
from toygraph.core.session import Session
from toygraph.data.batches import steps_per_epoch
from toygraph.data.preference import pair_batches
from toygraph.errors import GraphError
from toygraph.models.decoder import LoraConfig, build_decoder, lm_head

from .base import RecipeOptions, fused_head
from .lora import LoRA

#: The defaults of the preference options (TrainConfig and the CLI read them from here).
BETA = 0.1
LABEL_SMOOTHING = 0.0


class PreferenceRecipe(LoRA):
    """What DPO and ORPO share: pair batches, per-sequence log-probs, metrics."""

    make_batches = staticmethod(pair_batches)

    @staticmethod
    def batches_per_epoch(items, batch: int, seq_len: int) -> int:
        return steps_per_epoch(len(items), batch)

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, beta: float = BETA):
        super().__init__(targets, rank, alpha)
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
            raise GraphError(f"beta must be a finite number > 0, got {beta!r}")
        self.beta = float(beta)
        self.last_metrics: dict[str, float] = {}

    # --- the graph ----------------------------------------------------------------------------
    def realize(self, gguf, model_cfg, opts: RecipeOptions) -> None:
        if opts.data_parallel:  # its loss is a per-pair mean, not a token sum the ranks can add
            raise GraphError(f"--recipe {type(self).__name__.lower()} does not run data parallel "
                             f"(under mpirun) yet: run it as one process")
        if opts.pack:  # a pair is two rows of one batch: its rows are not packed
            raise GraphError(f"--recipe {type(self).__name__.lower()} does not pack: drop --pack")
        g = self.build_graph(gguf, model_cfg, opts)
        self.train = build_training(self.loss, self.net.params, max_norm=opts.clip)
        self.sess = Session(g, backend=opts.backend, precision=opts.precision)
        self.sess.realize()
        self.step_index = 0

    def build_graph(self, gguf, model_cfg, opts: RecipeOptions) -> Graph:
        """The forward passes and the loss (``self.loss``), without the optimizer."""
        self.check_model(model_cfg, opts)
        self.opts, self.model_cfg = opts, model_cfg
        self.graph = g = Graph()
        B, T = opts.batch, opts.seq_len
        self.rows = 2 * B
        self.net = build_decoder(g, model_cfg, batch=2 * B, seq_len=T, model=gguf, weights="frozen",
                                 lora=self.lora_config(opts), seed=opts.seed, logits=False)
        self.labels = g.input("labels", (2 * B * T,), "i32")
        # 1 / (valid pairs of the micro-batch) on valid pairs, 0 on padding pairs.
        self.pair_weight = g.input("pair_weight", (B,))
        self.sign = g.const("pair_sign", np.array([[1.0], [-1.0]], np.float32))
        self.policy = g.output(self.sequence_logprobs(self.net))
        self.loss = g.output(self.build_loss(g, opts))
        return g

    def sequence_logprobs(self, net):
        """[2B]: each row's summed log-probs of its labels (response tokens only). Where the
        SFT recipes fuse the head with their loss (base.fused_head: always on CUDA), the
        per-token log-probs come from the fused head too, minus its per-row losses, so no
        [2B * seq_len, vocab] logits exist."""
        T = self.opts.seq_len
        if fused_head(self.opts.backend):
            nll = ops.linear_cross_entropy(net.hidden, net.head, self.labels, reduction="none")
            return ops.scale(ops.sum(nll.reshape(self.rows, T), axis=1), -1.0)
        lp = ops.token_logprobs(lm_head(net), self.labels)
        return ops.sum(lp.reshape(self.rows, T), axis=1)

    def chosen_minus_rejected(self, x):
        """[2B] -> [B]: x[chosen i] - x[rejected i]."""
        return ops.sum(ops.mul(x.reshape(2, self.rows // 2), self.sign), axis=0)

    def build_loss(self, g: Graph, opts: RecipeOptions):
        raise NotImplementedError

    # --- per step -------------------------------------------------------------------------------
    def batch_rows(self):
        return self.rows, "2 * batch (chosen rows, then rejected)"

    def _upload(self, ids, pos, lab):
        """Upload a micro-batch and the weights derived from its labels; returns the mask
        of its valid pairs (both sequences have a target token)."""
        lab = np.asarray(lab)
        n_row = (lab >= 0).sum(axis=1)
        B = self.rows // 2
        valid = (n_row[:B] > 0) & (n_row[B:] > 0)
        s = self.sess
        s.upload(self.net.tokens, ids)
        s.upload(self.net.positions, pos)
        s.upload(self.labels, lab.reshape(-1))
        s.upload(self.pair_weight, (valid / max(int(valid.sum()), 1)).astype(np.float32))
        self.upload_row_weights(n_row)
        return valid

    def upload_row_weights(self, n_row):
        """Inputs a recipe derives from the rows' target counts (ORPO's averages)."""

    def step(self, token_ids, positions, labels, hp, is_first: bool, segments=None) -> float:
        """One optimizer step; returns the loss before the update (the mean over the k
        micro-batches) and keeps the metrics in ``last_metrics``."""
        s = self.sess
        micro = self._begin_step(token_ids, positions, labels, hp, is_first, segments)
        losses, parts = [], []
        for i, (ids, pos, lab, _) in enumerate(micro):  # pairs are never packed
            valid = self._upload(ids, pos, lab)
            s.run("step" if i == len(micro) - 1 else "backward")
            losses.append(float(s.download(self.loss)))
            parts.append(self.pair_values(valid))
        self.step_index += 1
        self.last_metrics = self.metrics(parts, float(np.mean(losses)))
        return self.last_metrics["loss"]

    def evaluate(self, token_ids, positions, labels) -> tuple[float, int]:
        """Forward only on one batch [2 * batch, seq_len]: (loss x valid pairs, valid
        pairs); the batch's metrics go to ``last_metrics``."""
        valid = self._upload(token_ids, positions, labels)
        self.sess.run("forward")
        loss = float(self.sess.download(self.loss))
        self.last_metrics = self.metrics([self.pair_values(valid)], loss)
        n = int(valid.sum())
        return loss * n, n

    # --- metrics --------------------------------------------------------------------------------
    def pair_values(self, valid) -> dict[str, np.ndarray]:
        """Per valid pair of the micro-batch just run: rewards of both responses (and any
        recipe-specific values)."""
        raise NotImplementedError

    def metrics(self, parts: list[dict], loss: float) -> dict[str, float]:
        """Means over every valid pair of the step: rewards/chosen, rewards/rejected,
        rewards/margin (chosen - rejected), rewards/accuracy (chosen > rejected)."""
        pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        chosen, rejected = pooled.pop("chosen"), pooled.pop("rejected")
        def mean(v):  # NaN (null in events.jsonl) when a batch holds no pair at all
            return float(np.mean(v)) if len(v) else float("nan")
        out = {"loss": loss, "rewards/chosen": mean(chosen), "rewards/rejected": mean(rejected),
               "rewards/margin": mean(chosen - rejected),
               "rewards/accuracy": mean(chosen > rejected)}
        out.update({k: mean(v) for k, v in pooled.items()})
        return out

    def split(self, t, valid):
        """A downloaded [2B] output as (chosen, rejected) values of the valid pairs."""
        x = self.sess.download(t).astype(np.float64)
        B = self.rows // 2
        return x[:B][valid], x[B:][valid]


class DPO(PreferenceRecipe):
    """Direct Preference Optimization (sigmoid loss, optional label smoothing) against the
    frozen base (or base + the initial adapter when ``reference_adapter``).

    >>> DPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1, label_smoothing=0.0)
    DPO(targets=('q', 'v'), rank=8, alpha=16, beta=0.1, label_smoothing=0.0)
    """

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, beta: float = BETA,
                 label_smoothing: float = LABEL_SMOOTHING, reference_adapter: bool = False):
        super().__init__(targets, rank, alpha, beta)
        if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 0.5):
            raise GraphError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)
        self.reference_adapter = bool(reference_adapter)

    def __repr__(self):
        return (f"DPO(targets={self.targets}, rank={self.rank}, alpha={self.alpha}, "
                f"beta={self.beta}, label_smoothing={self.label_smoothing})")

    def build_loss(self, g, opts):
        self.ref_net = build_decoder(g, self.model_cfg, batch=self.rows, seq_len=opts.seq_len,
                                     logits=False,
                                     lora=self.lora_config(opts) if self.reference_adapter else None,
                                     reference_of=self.net)
        self.reference = g.output(self.sequence_logprobs(self.ref_net))
        z = ops.scale(self.chosen_minus_rejected(ops.sub(self.policy, self.reference)), self.beta)
        ls = self.label_smoothing
        losses = ops.scale(ops.softplus(ops.scale(z, -1.0)), 1.0 - ls)  # -logsigmoid(z) (1 - ls)
        if ls:
            losses = ops.add(losses, ops.scale(ops.softplus(z), ls))    # - logsigmoid(-z) ls
        return ops.sum(ops.mul(losses, self.pair_weight))

    def load_adapter_init(self, values: dict[str, np.ndarray]) -> None:
        """Start from an adapter: the policy's, and the frozen reference's when it has one."""
        self.load_trainable(values)
        if self.reference_adapter:
            ref = {p.name: p for p in self.ref_net.params}
            for name, v in values.items():
                self.sess.load_param(ref["reference." + name], v)

    def pair_values(self, valid):
        pc, pr = self.split(self.policy, valid)
        rc, rr = self.split(self.reference, valid)
        return {"chosen": self.beta * (pc - rc), "rejected": self.beta * (pr - rr),
                "logps/chosen": pc, "logps/rejected": pr}


class ORPO(PreferenceRecipe):
    """Odds Ratio Preference Optimization: the chosen responses' NLL minus beta times the
    log-sigmoid of the log-odds ratio; no reference pass.

    >>> ORPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1)
    ORPO(targets=('q', 'v'), rank=8, alpha=16, beta=0.1)
    """

    def __repr__(self):
        return f"ORPO(targets={self.targets}, rank={self.rank}, alpha={self.alpha}, beta={self.beta})"

    def build_loss(self, g, opts):
        R = self.rows
        self.inv_len = g.input("inv_len", (R,))        # 1 / a row's target tokens; 0: padding
        # -1 on padding rows (0 elsewhere) keeps log1mexp finite there; their pairs weigh 0.
        self.pad_shift = g.input("pad_shift", (R,))
        # 1 / the chosen rows' target tokens on chosen rows, 0 elsewhere: the NLL is the
        # mean over every chosen token of the micro-batch, as TRL's cross-entropy.
        self.nll_weight = g.input("nll_weight", (R,))
        self.mean_logps = g.output(ops.add(ops.mul(self.policy, self.inv_len), self.pad_shift))
        self.log_odds = g.output(ops.sub(self.chosen_minus_rejected(self.mean_logps),
                                         self.chosen_minus_rejected(ops.log1mexp(self.mean_logps))))
        self.nll = g.output(ops.scale(ops.sum(ops.mul(self.policy, self.nll_weight)), -1.0))
        odds = ops.sum(ops.mul(ops.log_sigmoid(self.log_odds), self.pair_weight))
        return ops.sub(self.nll, ops.scale(odds, self.beta))

    def upload_row_weights(self, n_row):
        B = self.rows // 2
        has = n_row > 0
        inv = np.where(has, 1.0 / np.maximum(n_row, 1), 0.0)
        nll = np.zeros(self.rows)
        nll[:B] = 1.0 / max(int(n_row[:B].sum()), 1)
        for t, v in ((self.inv_len, inv), (self.pad_shift, np.where(has, 0.0, -1.0)),
                     (self.nll_weight, nll)):
            self.sess.upload(t, v.astype(np.float32))

    def pair_values(self, valid):
        lc, lr = self.split(self.mean_logps, valid)
        odds = self.sess.download(self.log_odds).astype(np.float64)[valid]
        return {"chosen": self.beta * lc, "rejected": self.beta * lr, "nll": np.full(
                len(lc), float(self.sess.download(self.nll))), "log_odds_ratio":
                -np.logaddexp(0.0, -odds), "log_odds_chosen": odds}
