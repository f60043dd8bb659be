"""LoRA: the GGUF base stays frozen (and quantized where it is); only adapters train."""
from __future__ import annotations

from toygraph.models.decoder import TARGETS, LoraConfig
from toygraph.recipes.base import Recipe, RecipeOptions
from toygraph.recipes.registry import register


@register("lora")
class LoRA(Recipe):
    """Low-rank adapters on any of q, k, v, o, gate, up, down.

    >>> LoRA(targets=("q", "v"), rank=8, alpha=16)      # doctest: +ELLIPSIS
    LoRA(targets=('q', 'v'), rank=8, alpha=16)
    """

    weight_mode = "frozen"
    trains_adapter = True

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha):
        self.targets, self.rank, self.alpha = tuple(targets), int(rank), alpha
        LoraConfig(targets=self.targets, rank=self.rank, alpha=alpha)  # validate now

    @classmethod
    def from_options(cls, cfg) -> "LoRA":
        return cls(targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha)

    def __repr__(self):
        return f"LoRA(targets={self.targets}, rank={self.rank}, alpha={self.alpha})"

    def lora_config(self, opts: RecipeOptions) -> LoraConfig:
        return LoraConfig(targets=self.targets, rank=self.rank, alpha=self.alpha,
                          seed=opts.seed, init_scale=opts.init_scale)

    @property
    def all_targets(self):
        return tuple(TARGETS)
