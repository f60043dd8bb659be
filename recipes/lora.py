"""LoRA: the GGUF base stays frozen (and quantized where it is); only adapters train."""
from __future__ import annotations

from toygraph.distributed import world
from toygraph.models.decoder import ALL_TARGETS, LoraConfig
from toygraph.recipes.base import Recipe, RecipeOptions
from toygraph.recipes.registry import register


@register("lora")
class LoRA(Recipe):
    """Low-rank adapters on any of q, k, v, o, gate, up, down (and a mixture of experts'
    experts: gate_up_exps, down_exps, or both as "experts").

    >>> LoRA(targets=("q", "v"), rank=8, alpha=16)      # doctest: +ELLIPSIS
    LoRA(targets=('q', 'v'), rank=8, alpha=16)
    """

    summary = "LoRA adapters on the frozen base"   # the --recipe help

    weight_mode = "frozen"
    trains_adapter = True

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, *, rslora: bool = LoraConfig.rslora,
                 dora: bool = LoraConfig.dora, plus_ratio: float = LoraConfig.plus_ratio,
                 dropout: float = LoraConfig.dropout):
        self.rank, self.alpha = int(rank), alpha
        # the LoRA variants (LoraConfig's docstring)
        self.variants = dict(rslora=bool(rslora), dora=bool(dora), plus_ratio=float(plus_ratio),
                             dropout=float(dropout))
        # validated now; "experts" names its expert targets (decoder.TARGET_GROUPS)
        self.targets = LoraConfig(targets=tuple(targets), rank=self.rank, alpha=alpha,
                                  **self.variants).targets

    @classmethod
    def from_options(cls, cfg) -> "LoRA":
        return cls(targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha, rslora=cfg.rslora,
                   dora=cfg.dora, plus_ratio=cfg.lora_plus_ratio, dropout=cfg.lora_dropout)

    def __repr__(self):
        changed = "".join(f", {k}={v}" for k, v in self.variants.items()
                          if v != getattr(LoraConfig, k))
        return f"LoRA(targets={self.targets}, rank={self.rank}, alpha={self.alpha}{changed})"

    def lora_config(self, opts: RecipeOptions) -> LoraConfig:
        # data parallel: each rank draws its own dropout masks
        stream = world().rank if opts.data_parallel and self.variants["dropout"] else 0
        return LoraConfig(targets=self.targets, rank=self.rank, alpha=self.alpha,
                          seed=opts.seed, init_scale=opts.init_scale, dropout_stream=stream,
                          **self.variants)

    def lr_scales(self) -> dict:
        """LoRA+: B's learning rate (and DoRA's magnitudes', as PEFT's
        create_loraplus_optimizer puts every 1-D tensor in B's group) is lr * ratio."""
        ratio = self.variants["plus_ratio"]
        if ratio == 1.0:
            return {}
        return {t: ratio for t in [b for _, b in self.net.lora.values()]
                + list(self.net.magnitudes.values())}

    @property
    def all_targets(self):
        return tuple(ALL_TARGETS)
