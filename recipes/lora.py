"""LoRA: the GGUF base stays frozen (and quantized where it is); only adapters train."""
from __future__ import annotations

from dataclasses import dataclass

from toygraph.distributed import world
from toygraph.errors import ToygraphError
from toygraph.models.decoder import ALL_TARGETS, LoraConfig
from toygraph.recipes.base import Recipe, RecipeOptions
from toygraph.recipes.options import AdapterOptions, PackingOptions, option
from toygraph.recipes.registry import register


@dataclass(kw_only=True)
class LoRAOptions(AdapterOptions, PackingOptions):
    """The plain LoRA recipe's: its variants (LoraConfig's docstring). The preference and
    GRPO recipes (its subclasses) build reference and sampling passes that do not take them."""

    rslora: bool = option(LoraConfig.rslora, help="rsLoRA: scale the update by alpha / "
                                                  "sqrt(rank) instead of alpha / rank",
                          group="adapter")
    dora: bool = option(LoraConfig.dora, help="DoRA: a trainable magnitude per output row "
                                              "times the direction of W + scale * B A",
                        group="adapter", resume="never")
    lora_plus_ratio: float = option(LoraConfig.lora_plus_ratio,
                                    help="LoRA+: the B matrices' learning rate is the peak "
                                         "learning rate times this (A's: that rate)",
                                    group="adapter", low=0, open_low=True)
    lora_dropout: float = option(LoraConfig.lora_dropout, help="dropout on each adapter's input "
                                                               "while training (not with --dora)",
                                 group="adapter", low=0, high=1)

    def check(cfg):
        if cfg.dora and cfg.lora_dropout:   # PEFT would drop DoRA's base term's input too
            raise ToygraphError("--lora-dropout together with --dora is not supported")


@register("lora")
class LoRA(Recipe):
    """Low-rank adapters on any of q, k, v, o, gate, up, down (and a mixture of experts'
    experts: gate_up_exps, down_exps, or both as "experts").

    >>> LoRA(targets=("q", "v"), rank=8, alpha=16)      # doctest: +ELLIPSIS
    LoRA(targets=('q', 'v'), rank=8, alpha=16)
    """

    summary = "LoRA adapters on the frozen base"   # the --recipe help
    Options = LoRAOptions

    weight_mode = "frozen"
    trains_adapter = True

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, *, rslora: bool = LoraConfig.rslora,
                 dora: bool = LoraConfig.dora,
                 lora_plus_ratio: float = LoraConfig.lora_plus_ratio,
                 lora_dropout: float = LoraConfig.lora_dropout):
        self.rank, self.alpha = int(rank), alpha
        # the LoRA variants (LoraConfig's docstring)
        self.variants = dict(rslora=bool(rslora), dora=bool(dora),
                             lora_plus_ratio=float(lora_plus_ratio),
                             lora_dropout=float(lora_dropout))
        # validated now; "experts" names its expert targets (decoder.TARGET_GROUPS)
        self.targets = LoraConfig(targets=tuple(targets), rank=self.rank, alpha=alpha,
                                  **self.variants).targets

    @classmethod
    def from_options(cls, cfg) -> "LoRA":
        return cls(targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha, rslora=cfg.rslora,
                   dora=cfg.dora, lora_plus_ratio=cfg.lora_plus_ratio,
                   lora_dropout=cfg.lora_dropout)

    def __repr__(self):
        changed = "".join(f", {k}={v}" for k, v in self.variants.items()
                          if v != getattr(LoraConfig, k))
        return f"LoRA(targets={self.targets}, rank={self.rank}, alpha={self.alpha}{changed})"

    def lora_config(self, opts: RecipeOptions) -> LoraConfig:
        # data parallel: each rank draws its own dropout masks
        stream = world().rank if opts.data_parallel and self.variants["lora_dropout"] else 0
        return LoraConfig(targets=self.targets, rank=self.rank, alpha=self.alpha,
                          seed=opts.seed, init_scale=opts.init_scale, dropout_stream=stream,
                          **self.variants)

    def lr_scales(self) -> dict:
        """LoRA+: B's learning rate (and DoRA's magnitudes', as PEFT's
        create_loraplus_optimizer puts every 1-D tensor in B's group) is lr * ratio."""
        ratio = self.variants["lora_plus_ratio"]
        if ratio == 1.0:
            return {}
        return {t: ratio for t in [b for _, b in self.net.lora.values()]
                + list(self.net.magnitudes.values())}

    @property
    def all_targets(self):
        return tuple(ALL_TARGETS)
