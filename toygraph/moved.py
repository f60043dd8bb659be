"""The import paths of toygraph 0.1, kept for one release (removed in 0.3).

0.2 sorted the modules into sub-packages by layer (docs/design.md). A program that still
imports ``toygraph.optim`` or ``toygraph.preference`` gets the module at its new place,
with a DeprecationWarning naming it, through the finder below: one table, no copies of
the modules. (``toygraph.gguf`` is a package now; its ``GGUFModel`` is forwarded by
toygraph/gguf/__init__.py the same way.)
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module -> where it lives now
MOVED = {
    "toygraph.settings": "toygraph.environment",
    "toygraph.gguf_reader": "toygraph.gguf.reader",
    "toygraph.quant": "toygraph.gguf.blocks",
    "toygraph.quant_encode": "toygraph.gguf.block_encode",
    "toygraph.tokenizer": "toygraph.gguf.tokenizer",
    "toygraph.graph": "toygraph.core.graph",
    "toygraph.ops": "toygraph.core.ops",
    "toygraph.autodiff": "toygraph.core.autodiff",
    "toygraph.optim": "toygraph.core.optimizer",
    "toygraph.recompute": "toygraph.core.recompute",
    "toygraph.memory": "toygraph.core.memory",
    "toygraph.session": "toygraph.core.session",
    "toygraph.distributed": "toygraph.core.distributed",
    "toygraph.examples": "toygraph.data.examples",
    "toygraph.encoding": "toygraph.data.encoding",
    "toygraph.packing": "toygraph.data.packing",
    "toygraph.preference": "toygraph.data.preference",
    "toygraph.export": "toygraph.adapters.merge",
    "toygraph.modelfile": "toygraph.adapters.modelfile",
    "toygraph.kvcache": "toygraph.inference.kvcache",
    "toygraph.sampling": "toygraph.inference.sampling",
    "toygraph.chat": "toygraph.inference.chat",
    "toygraph.train": "toygraph.training.run",
    "toygraph.trainer": "toygraph.training.loop",
    "toygraph.config": "toygraph.training.run_config",
    "toygraph.resume": "toygraph.training.resume",
    "toygraph.checkpoint": "toygraph.training.checkpoints",
    "toygraph.runs": "toygraph.training.run_dir",
    "toygraph.guard": "toygraph.training.guard",
    "toygraph.supervisor": "toygraph.training.supervisor",
    "toygraph.plot": "toygraph.training.plot",
}


def warn_moved(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} in toygraph 0.2; the old name goes in 0.3",
                  DeprecationWarning, stacklevel=3)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and hands out the module at its new place."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warn_moved(spec.name, MOVED[spec.name])
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass   # the module ran when it was imported under its new name


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
