"""FromScratch: every weight trains, from a random start."""
from __future__ import annotations

from toygraph.recipes.base import Recipe
from toygraph.recipes.registry import register


@register("scratch")
class FromScratch(Recipe):
    """Random init (N(0, 0.02) matrices, unit norms), embeddings included."""

    summary = "every weight, random"   # the --recipe help

    weight_mode = "scratch"

    def __repr__(self):
        return "FromScratch()"
