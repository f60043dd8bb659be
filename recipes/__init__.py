"""Recipes: LoRA, FullFinetune, FromScratch, DPO, ORPO, GRPO (importable as ``toygraph.recipes``).

Each recipe is one module that registers itself (registry.py); importing this package
imports them all, so ``RECIPES`` holds every name ``--recipe`` accepts.
"""
# isort: off (registration order is the order --recipe lists them in)
from toygraph.recipes.base import Recipe, RecipeOptions
from toygraph.recipes.lora import LoRA
from toygraph.recipes.full import FullFinetune
from toygraph.recipes.scratch import FromScratch
from toygraph.recipes.dpo import DPO
from toygraph.recipes.orpo import ORPO
from toygraph.recipes.grpo import GRPO
from toygraph.recipes.registry import RECIPES, recipe_class
# isort: on

__all__ = ["Recipe", "RecipeOptions", "LoRA", "FullFinetune", "FromScratch", "DPO", "ORPO", "GRPO",
           "RECIPES", "recipe_class"]
