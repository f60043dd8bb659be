"""What the preference recipes (DPO, ORPO) share: chosen/rejected pairs as data, the
per-sequence log-probabilities of the replies, the pair weights and the metrics.

A micro-batch of ``batch`` pairs is ``2 * batch`` rows: the chosen sequences first,
then the rejected ones in the same order (toygraph.data.preference.pair_batches builds them).
Labels mark the response tokens only (-1 elsewhere); a sequence's log-probability is the
sum of its labels' log-probs. Both losses average over the pairs of a micro-batch; k
accumulated micro-batches average their losses (as TRL does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.data.batches import steps_per_epoch
from toygraph.data.preference import encode_pairs, load_pairs, pair_batches
from toygraph.errors import GraphError
from toygraph.models.decoder import LoraConfig, fused_head_loss, lm_head
from toygraph.recipes.base import RecipeOptions, fused_head
from toygraph.recipes.lora import LoRA
from toygraph.recipes.options import AdapterOptions, option

#: The default of the preference strength.
BETA = 0.1


@dataclass(kw_only=True)
class PreferenceOptions(AdapterOptions):
    """What the preference recipes take besides the adapter's shape."""

    beta: float = option(BETA, help="dpo: strength of the pull towards the reference; orpo: "
                                    "odds-ratio weight", group="adapter", low=0, open_low=True)


class PreferenceRecipe(LoRA):
    """LoRA trained on chosen/rejected pairs; a subclass gives the loss of the pairs
    (:meth:`preference_loss`) and the values its metrics are made of (:meth:`pair_values`)."""

    Options = PreferenceOptions

    eval_unit = "pairs"
    load_data = staticmethod(load_pairs)
    encode_data = staticmethod(encode_pairs)
    make_batches = staticmethod(pair_batches)

    @staticmethod
    def batches_per_epoch(items, batch: int, seq_len: int) -> int:
        return steps_per_epoch(len(items), batch)

    @staticmethod
    def packing_report(items, batch: int, seq_len: int) -> None:
        return None   # a pair is two rows of one batch: its rows are never packed

    def labelled_share(self, items, batch: int, seq_len: int, pack: bool) -> None:
        return None   # pairs: their per-token log-probs keep fused_head's other rules

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, beta: float = BETA):
        super().__init__(targets, rank, alpha)
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
            raise GraphError(f"beta must be a finite number > 0, got {beta!r}")
        self.beta = float(beta)
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def from_options(cls, cfg):
        return cls(targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha, beta=cfg.beta)

    # --- the graph ----------------------------------------------------------------------------
    def check_options(self, opts: RecipeOptions) -> None:
        if opts.data_parallel:  # its loss is a per-pair mean, not a token sum the ranks can add
            raise GraphError(f"--recipe {self.name} does not run data parallel "
                             f"(under mpirun) yet: run it as one process")
        if opts.pack:  # a pair is two rows of one batch: its rows are not packed
            raise GraphError(f"--recipe {self.name} does not pack: drop --pack")

    def rows_per_batch(self, opts: RecipeOptions) -> int:
        return 2 * opts.batch

    def build_loss(self, g: Graph, opts: RecipeOptions):
        """The per-pair loss of :meth:`preference_loss`, averaged over the valid pairs (no
        target count: the loss is already a mean)."""
        self.rows = R = 2 * opts.batch
        # 1 / (valid pairs of the micro-batch) on valid pairs, 0 on padding pairs.
        self.pair_weight = g.input("pair_weight", (R // 2,))
        self.sign = g.const("pair_sign", np.array([[1.0], [-1.0]], np.float32))
        # A reference model's pass first: the step's plan then runs it before the policy's
        # forward, so nothing of the fused head's lies between the policy's loss and its
        # gradient, and the two pair up (replay.HANDOFFS: the gradient reads the loss's
        # last chunk of softmax instead of recomputing it, the same bits).
        self.reference_logprobs(g, opts)
        self.policy = g.output(self.sequence_logprobs(self.net))
        return g.output(self.preference_loss(g, opts)), None

    def reference_logprobs(self, g: Graph, opts: RecipeOptions) -> None:
        """Build the reference model's pass, where the recipe has one (DPO)."""

    def preference_loss(self, g: Graph, opts: RecipeOptions):
        raise NotImplementedError

    def sequence_logprobs(self, net):
        """[2B]: each row's summed log-probs of its labels (response tokens only). Where the
        SFT recipes fuse the head with their loss (base.fused_head: always on CUDA), the
        per-token log-probs come from the fused head too, minus its per-row losses, so no
        [2B * seq_len, vocab] logits exist."""
        T = self.opts.seq_len
        if fused_head(self.opts.backend, self.model_cfg, net.hidden.shape[0]):
            nll = fused_head_loss(net, net.hidden, self.labels, "none")
            return ops.scale(ops.sum(nll.reshape(self.rows, T), axis=1), -1.0)
        lp = ops.token_logprobs(lm_head(net), self.labels)
        return ops.sum(lp.reshape(self.rows, T), axis=1)

    def chosen_minus_rejected(self, x):
        """[2B] -> [B]: x[chosen i] - x[rejected i]."""
        return ops.sum(ops.mul(x.reshape(2, self.rows // 2), self.sign), axis=0)

    # --- per step -------------------------------------------------------------------------------
    def batch_rows(self):
        return self.rows, "2 * batch (chosen rows, then rejected)"

    def upload(self, ids, pos, lab, seg=None):
        """Upload a micro-batch and the weights derived from its labels; keeps the mask of
        its valid pairs (both sequences have a target token) for :meth:`collect`."""
        lab = np.asarray(lab)
        n_row = (lab >= 0).sum(axis=1)
        B = self.rows // 2
        self.valid = (n_row[:B] > 0) & (n_row[B:] > 0)
        s = self.sess
        s.upload(self.net.tokens, ids)
        s.upload(self.net.positions, pos)
        s.upload(self.labels, lab.reshape(-1))
        s.upload(self.pair_weight, (self.valid / max(int(self.valid.sum()), 1)).astype(np.float32))
        self.upload_row_weights(n_row)

    def upload_row_weights(self, n_row):
        """Inputs a recipe derives from the rows' target counts (ORPO's averages)."""

    def collect(self, sums: dict) -> None:
        sums.setdefault("losses", []).append(float(self.sess.download(self.loss)))
        sums.setdefault("parts", []).append(self.pair_values(self.valid))

    def finish_step(self, sums: dict) -> float:
        """The mean of the micro-batches' losses; the metrics go to ``last_metrics``."""
        self.last_metrics = self.metrics(sums["parts"], float(np.mean(sums["losses"])))
        return self.last_metrics["loss"]

    def evaluate(self, token_ids, positions, labels, segments=None) -> tuple[float, int]:
        """Forward only on one batch [2 * batch, seq_len]: (loss x valid pairs, valid
        pairs); the batch's metrics go to ``last_metrics``."""
        self.upload(token_ids, positions, labels)
        self.sess.run("forward")
        loss = float(self.sess.download(self.loss))
        self.last_metrics = self.metrics([self.pair_values(self.valid)], loss)
        n = int(self.valid.sum())
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

    @staticmethod
    def metrics_text(metrics: dict) -> str:
        """Margin and accuracy of the rewards, for the progress line."""
        if "rewards/margin" not in metrics:
            return ""
        return f"margin {metrics['rewards/margin']:+.3f} acc {metrics['rewards/accuracy']:.2f}"

    def split(self, t, valid):
        """A downloaded [2B] output as (chosen, rejected) values of the valid pairs."""
        x = self.sess.download(t).astype(np.float64)
        B = self.rows // 2
        return x[:B][valid], x[B:][valid]
