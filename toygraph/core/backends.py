"""The backends a Session runs on, found by name, so the core imports none above it.

The numpy backend ("cpu", core/numpy_backend.py) is the core's own. Any other registers
itself with :func:`register` when its module is imported, and its package names that
module as an entry point of the group ``toygraph.backends`` (pyproject.toml: ``cuda =
"toygraph.cuda.backend"``), which :func:`make` loads the first time a session asks for the
name. A backend is made from the session's ``precision`` and ``dtype``; it checks what it
cannot run itself.

>>> backend = make("cuda", precision="bf16", dtype="f32")   # doctest: +SKIP
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from toygraph.precision import BACKENDS, precision_error
from toygraph.errors import GraphError

#: The entry-point group a package declares its backends in.
GROUP = "toygraph.backends"


def _numpy(precision: str, dtype: str):
    from toygraph.core.numpy_backend import CpuBackend
    return CpuBackend(dtype)


#: name -> factory(precision, dtype) -> backend
FACTORIES: dict[str, Callable] = {"cpu": _numpy}


def register(name: str, factory: Callable) -> None:
    """Make ``factory(precision, dtype)`` the backend ``Session(backend=name)`` runs on."""
    FACTORIES[name] = factory


def make(name: str, precision: str, dtype: str):
    """The backend ``name`` for a session computing at ``precision`` in ``dtype`` buffers."""
    if name not in BACKENDS:
        raise GraphError(f"backend must be {' or '.join(map(repr, BACKENDS))}, got {name!r}")
    why = precision_error(precision, name)
    if why:
        raise GraphError(f"precision {why}")
    if name not in FACTORIES:
        for ep in entry_points(group=GROUP, name=name):
            ep.load()   # the module registers itself
    if name not in FACTORIES:
        raise GraphError(f"backend {name!r} is not installed: no entry point {name!r} in the "
                         f"group {GROUP!r} registers it (an install of toygraph made before "
                         f"the group existed: run `pip install -e .` again)")
    return FACTORIES[name](precision, dtype)
