"""Recipes: LoRA, FullFinetune, FromScratch (importable as ``toygraph.recipes``)."""
from .base import Recipe, RecipeOptions
from .full import FromScratch, FullFinetune
from .lora import LoRA

RECIPES = {"lora": LoRA, "full": FullFinetune, "scratch": FromScratch}

__all__ = ["Recipe", "RecipeOptions", "LoRA", "FullFinetune", "FromScratch", "RECIPES"]
