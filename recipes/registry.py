"""The recipes by name: each recipe module registers its class, so ``--recipe NAME``, the
run configuration's choices and the training loop find it here and nowhere else.

>>> @register("lora")                          # doctest: +SKIP
... class LoRA(Recipe): ...
>>> recipe_class("lora")                       # doctest: +SKIP
<class 'toygraph.recipes.lora.LoRA'>
"""
from __future__ import annotations

from toygraph.errors import ToygraphError

#: Every registered recipe class by its name, in registration order.
RECIPES: dict[str, type] = {}


def register(name: str):
    """Register the decorated recipe class as ``name``."""
    def add(cls):
        if name in RECIPES:
            raise ToygraphError(f"two recipes are named {name!r}")
        cls.name = name
        RECIPES[name] = cls
        return cls
    return add


def recipe_class(name: str) -> type:
    """The recipe registered as ``name``; a one-line error listing the names otherwise."""
    cls = RECIPES.get(name)
    if cls is None:
        raise ToygraphError(f"--recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    return cls
