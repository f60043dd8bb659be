"""Recipes: LoRA, FullFinetune, FromScratch, DPO, ORPO (importable as ``toygraph.recipes``)."""
from .base import Recipe, RecipeOptions
from .dpo import DPO, ORPO
from .full import FromScratch, FullFinetune
from .lora import LoRA

RECIPES = {"lora": LoRA, "full": FullFinetune, "scratch": FromScratch, "dpo": DPO, "orpo": ORPO}

__all__ = ["Recipe", "RecipeOptions", "LoRA", "FullFinetune", "FromScratch", "DPO", "ORPO",
           "RECIPES"]
