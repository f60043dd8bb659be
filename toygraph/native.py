"""Build C++ source into a shared library with the host compiler (g++), cached on disk.

Two users: the host executor (toygraph/cuda/host/compiler.py builds the CUDA kernels as
host C++) and the CPU engine (toygraph/cpu/engine.cpp: block decoders and products on blocks). The cache key
is the sha256 of the source, the flags and ``g++ --version``; each library is written
atomically (temp file + os.replace) into a folder under ``$TOYGRAPH_CACHE/kernels``.

>>> path, built = build_shared(source, ["-O2"], folder, "the CPU engine")   # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from toygraph.errors import ToygraphError


def compiler() -> str | None:
    """The host C++ compiler: ``$CXX``, else g++ on the PATH, else None."""
    return os.environ.get("CXX") or shutil.which("g++")


@lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    """``cxx --version`` (part of every cache key: a new compiler rebuilds)."""
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ToygraphError(f"host compiler {cxx!r} does not run: {e}") from None


def build_shared(source: str, flags, folder: Path, what: str, *, cxx: str | None = None,
                 use_cache: bool = True, error=ToygraphError) -> tuple[Path, bool]:
    """(path of the shared library of ``source`` built with ``flags``, whether it was
    compiled now rather than found in ``folder``). A failed compile raises ``error`` naming
    ``what`` with the compiler's log."""
    cxx = cxx or compiler()
    if not cxx:
        raise error(f"building {what} needs a C++ compiler: g++ is not installed "
                    "(apt-get install g++, or set CXX)")
    flags = list(flags)
    try:
        version = compiler_version(cxx)
    except ToygraphError as e:
        raise error(str(e)) from None
    h = hashlib.sha256(source.encode())
    h.update(("\0" + " ".join(flags) + "\0" + version).encode())
    path = folder / f"{h.hexdigest()}.so"
    if use_cache and path.is_file():
        return path, False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
    except OSError:  # a read-only cache only costs a rebuild next time
        work = Path(tempfile.mkdtemp(prefix="toygraph-native-"))
        path = work / path.name
    try:
        src, lib = work / "source.cpp", work / "lib.so"
        src.write_text(source)
        res = subprocess.run([cxx, *flags, "-o", str(lib), str(src)], capture_output=True,
                             text=True)
        if res.returncode != 0:
            log = (res.stderr or res.stdout).strip()
            raise error(f"host compile of {what} failed ({cxx} {' '.join(flags)}):\n"
                        f"{log[-8000:]}")
        os.replace(lib, path)
    finally:
        if path.parent != work:
            shutil.rmtree(work, ignore_errors=True)
    return path, True
