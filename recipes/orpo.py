"""ORPO: Odds Ratio Preference Optimization with LoRA, no reference model.

>>> recipe = ORPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1)
>>> recipe.realize(model, model.config, RecipeOptions(seq_len=128, batch=2))   # doctest: +SKIP

The loss follows TRL (the ORPO paper's formula): ``nll(chosen) - b logsigmoid(log_odds)`` on
the responses' mean per-token log-probs, ``log_odds = (lc - lr) - (log(1 - e^lc) -
log(1 - e^lr))``. Pairs and metrics are the preference recipes' (preference.py).
"""
from __future__ import annotations

import numpy as np

from toygraph import ops
from toygraph.recipes.preference import PreferenceRecipe
from toygraph.recipes.registry import register


@register("orpo")
class ORPO(PreferenceRecipe):
    """Odds Ratio Preference Optimization: the chosen responses' NLL minus beta times the
    log-sigmoid of the log-odds ratio; no reference pass.

    >>> ORPO(targets=("q", "v"), rank=8, alpha=16, beta=0.1)
    ORPO(targets=('q', 'v'), rank=8, alpha=16, beta=0.1)
    """

    summary = "preference pairs, no reference pass, with LoRA"   # the --recipe help

    def __repr__(self):
        return f"ORPO(targets={self.targets}, rank={self.rank}, alpha={self.alpha}, beta={self.beta})"

    def preference_loss(self, g, opts):
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
