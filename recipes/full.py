"""FullFinetune: every weight trains, starting from the GGUF's."""
from __future__ import annotations

from toygraph.recipes.base import Recipe
from toygraph.recipes.registry import register


@register("full")
class FullFinetune(Recipe):
    """Start from the GGUF weights; quantized ones become trainable f32 copies."""

    summary = "every weight, from the GGUF"   # the --recipe help

    weight_mode = "finetune"

    def __repr__(self):
        return "FullFinetune()"
