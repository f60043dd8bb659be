"""DPO: Direct Preference Optimization with LoRA, one realized graph replayed per step.

>>> recipe = DPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1)
>>> recipe.realize(model, model.config, RecipeOptions(seq_len=128, batch=2))   # doctest: +SKIP
>>> loss = recipe.step(tokens, positions, labels, hp, is_first=True)          # doctest: +SKIP
>>> recipe.last_metrics["rewards/margin"]                                       # doctest: +SKIP

The reference model is the frozen base with the adapter switched off: a second forward
pass in the same graph, reading the same const (memory-mapped) base tensors, so the base
is held once. Started from an adapter (``--adapter-init``), the reference is base + that
adapter, frozen: a second set of adapter tensors that no gradient reaches.

The loss follows TRL (the DPO paper's formula): the sigmoid loss with label smoothing,
``-logsigmoid(b l) (1 - ls) - logsigmoid(-b l) ls`` with ``l = (pi_c - pi_r) - (ref_c -
ref_r)``, rewards ``b (pi - ref)``. Pairs and metrics are the preference recipes' (preference.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toygraph import ops
from toygraph.errors import GraphError
from toygraph.models.decoder import BuildOptions, LoraConfig, WeightSource, build_decoder
from toygraph.recipes.options import option
from toygraph.recipes.preference import BETA, PreferenceOptions, PreferenceRecipe
from toygraph.recipes.registry import register

#: The default of --label-smoothing.
LABEL_SMOOTHING = 0.0


@dataclass(kw_only=True)
class DPOOptions(PreferenceOptions):
    """DPO's besides the preference strength."""

    label_smoothing: float = option(LABEL_SMOOTHING,
                                    help="dpo: assumed chance a pair's preference is flipped "
                                         "(conservative DPO)",
                                    group="adapter", low=0, high=0.5)


@register("dpo")
class DPO(PreferenceRecipe):
    """Direct Preference Optimization (sigmoid loss, optional label smoothing) against the
    frozen base (or base + the initial adapter when ``reference_adapter``).

    >>> DPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1, label_smoothing=0.0)
    DPO(targets=('q', 'v'), rank=8, alpha=16, beta=0.1, label_smoothing=0.0)
    """

    summary = "preference pairs, against a frozen reference, with LoRA"   # the --recipe help
    Options = DPOOptions

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, beta: float = BETA,
                 label_smoothing: float = LABEL_SMOOTHING, reference_adapter: bool = False):
        super().__init__(targets, rank, alpha, beta)
        if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 0.5):
            raise GraphError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)
        self.reference_adapter = bool(reference_adapter)

    @classmethod
    def from_options(cls, cfg) -> "DPO":
        return cls(targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha, beta=cfg.beta,
                   label_smoothing=cfg.label_smoothing,
                   reference_adapter=bool(cfg.adapter_init))

    @classmethod
    def reference_adapter_dir(cls, cfg) -> str | None:
        """Started from an adapter, the reference model is base + that adapter."""
        return cfg.adapter_init or None

    def __repr__(self):
        return (f"DPO(targets={self.targets}, rank={self.rank}, alpha={self.alpha}, "
                f"beta={self.beta}, label_smoothing={self.label_smoothing})")

    def reference_logprobs(self, g, opts):
        self.ref_net = build_decoder(g, self.model_cfg, WeightSource(reference_of=self.net),
                                     batch=self.rows, seq_len=opts.seq_len,
                                     lora=self.lora_config(opts) if self.reference_adapter else None,
                                     options=BuildOptions(logits=False))
        self.reference = g.output(self.sequence_logprobs(self.ref_net))

    def preference_loss(self, g, opts):
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
