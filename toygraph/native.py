"""Build C++ source into a shared library with the host compiler (g++), cached on disk.

Two users: the host executor (toygraph/cuda/host/compiler.py builds the CUDA kernels as
host C++) and the CPU engine (toygraph/cpu/engine.cpp: block decoders and products on blocks). The cache key
is the sha256 of the source, the flags and ``g++ --version``; each library is written
atomically (temp file + os.replace) into a folder under ``$TOYGRAPH_CACHE/kernels``.

A cached library is verified, not trusted: beside ``KEY.so`` its record ``KEY.so.json``
holds the library's size, sha256 and defined symbols, and the library is used only when
all three still hold (and name every symbol the caller needs). A truncated copy of the
cache would otherwise be mapped and fault (SIGBUS) at the first call, a zero-byte one fail
on every run, a foreign one lack the entry points; each is rebuilt instead, said in one
line. A compile that runs past ``BUILD_TIMEOUT_S`` is killed, one that takes longer than
``SAY_AFTER_S`` says what it is doing, and a cache that cannot be written builds into a
temporary folder removed when the process ends (said once).

>>> path, built = build_shared(source, ["-O2"], folder, "the CPU engine")   # doctest: +SKIP
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from toygraph.atomic import file_sha256
from toygraph.bounded import read_bytes
from toygraph.errors import ToygraphError
from toygraph.files import not_regular

logger = logging.getLogger(__name__)

#: The longest one compile may run (the CPU engine takes about a minute on two cores);
#: a hung compiler is killed then, rather than printing nothing forever.
BUILD_TIMEOUT_S = 900.0
#: A compile running longer than this says what it is building, where, and its limit.
SAY_AFTER_S = 5.0
#: The record of a cached library is a few hundred bytes; larger is not one.
RECORD_BYTES = 1 << 16


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


def elf_symbols(path) -> set[str] | None:
    """The symbols an ELF64 shared library defines in its dynamic symbol table (what
    ``dlsym`` finds), read without loading it; None for a file this does not read (not
    ELF64: another platform's format, or not a library)."""
    data = Path(path).read_bytes()
    if data[:5] != b"\x7fELF\x02":
        return None
    e = "<" if data[5] == 1 else ">"
    try:
        shoff, = struct.unpack_from(e + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(e + "HH", data, 0x3A)
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        sections = [struct.unpack_from(e + "IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)]
        names = set()
        for sec in (s for s in sections if s[1] == 11):   # SHT_DYNSYM
            strings = sections[sec[6]][4]
            for off in range(sec[4], sec[4] + sec[5], sec[9] or 24):
                name, _, _, shndx = struct.unpack_from(e + "IBBH", data, off)
                if name and shndx:   # shndx 0: undefined here (imported)
                    start = strings + name
                    names.add(data[start:data.index(b"\0", start)].decode("ascii", "replace"))
        return names
    except (struct.error, ValueError, IndexError):
        return None


def _record_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".json")


def _record(lib: Path) -> dict:
    """What is known of a library just built: size, sha256, defined symbols."""
    symbols = elf_symbols(lib)
    return {"bytes": lib.stat().st_size, "sha256": file_sha256(lib),
            "symbols": sorted(symbols) if symbols is not None else None}


def cached_problem(lib: Path, symbols=()) -> str | None:
    """Why the cached library ``lib`` must not be loaded ("missing" when it is not
    there), or None when its record vouches for it: same size, same sha256, and every
    name of ``symbols`` among those it defines."""
    try:
        st = os.stat(lib)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    kind = not_regular(st.st_mode)
    if kind is not None:
        return f"is {kind}, not a library"
    if st.st_size == 0:
        return "is empty (0 bytes)"
    record_path = _record_path(lib)
    if not record_path.exists():
        return "has no checksum record (not built by this toygraph)"
    try:   # bounded, and never blocked on a FIFO
        record = json.loads(read_bytes(record_path, max_bytes=RECORD_BYTES))
        size, digest, defined = record["bytes"], record["sha256"], record["symbols"]
    except (ToygraphError, ValueError, KeyError, TypeError):
        return "has an unreadable checksum record"
    if st.st_size != size:
        return f"is {st.st_size:,} bytes, not the {size:,} built (truncated or replaced)"
    if file_sha256(lib) != digest:
        return "does not match its checksum (damaged or replaced)"
    missing = [name for name in symbols if defined is not None and name not in defined]
    if missing:
        return f"lacks {', '.join(missing)}"
    return None


def _work_folder(folder: Path, what: str) -> tuple[Path, bool]:
    """(a fresh folder to build in, whether it is temporary): inside the cache, or, when
    the cache cannot be written, a temporary one removed when the process ends."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=folder, prefix=".build-")), False
    except OSError as e:
        work = Path(tempfile.mkdtemp(prefix="toygraph-native-"))
        atexit.register(shutil.rmtree, work, True)
        logger.warning("the cache %s cannot be written (%s): building %s in %s, removed when "
                       "this process ends (every run builds it again)", folder,
                       e.strerror or e, what, work)
        return work, True


def _compile(cmd: list[str], what: str, error, say: bool) -> subprocess.CompletedProcess:
    """Run the compiler with a time limit, in its own process group (so the compiler's
    own children are killed with it); with ``say``, a slow build says what it is doing."""
    said = threading.Timer(SAY_AFTER_S, lambda: logger.warning(
        "building %s with %s (once; it is cached after) - up to %g s", what, cmd[0],
        BUILD_TIMEOUT_S))
    said.daemon = True
    if say:
        said.start()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise error(f"host compile of {what} did not finish in {BUILD_TIMEOUT_S:g} s "
                    f"({cmd[0]}); it was stopped") from None
    except BaseException:   # Ctrl-C: the compiler, in its own session, would outlive us
        _kill(proc)
        raise
    finally:
        said.cancel()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.communicate()


def build_shared(source: str, flags, folder: Path, what: str, *, cxx: str | None = None,
                 use_cache: bool = True, error=ToygraphError, symbols=(),
                 say: bool = False) -> tuple[Path, bool]:
    """(path of the shared library of ``source`` built with ``flags``, whether it was
    compiled now rather than found in ``folder``). ``symbols``: names the library must
    define (a cached one without them is rebuilt, a build without them is an error).
    ``say``: a build past SAY_AFTER_S says so (the CPU engine's, which a user waits for
    on a first run; the host executor's test builds stay quiet). A failed compile raises
    ``error`` naming ``what`` with the compiler's log."""
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
    if use_cache:
        problem = cached_problem(path, symbols)
        if problem is None:
            return path, False
        if problem != "missing":
            logger.warning("the cached library of %s, %s, %s: rebuilding it", what, path, problem)
    work, temporary = _work_folder(folder, what)
    if temporary:
        path = work / path.name
    try:
        src, lib = work / "source.cpp", work / "lib.so"
        src.write_text(source)
        res = _compile([cxx, *flags, "-o", str(lib), str(src)], what, error, say)
        if res.returncode != 0:
            log = (res.stderr or res.stdout).strip()
            raise error(f"host compile of {what} failed ({cxx} {' '.join(flags)}):\n"
                        f"{log[-8000:]}")
        record = _record(lib)
        missing = [n for n in symbols if record["symbols"] is not None
                   and n not in record["symbols"]]
        if missing:
            raise error(f"host compile of {what} made a library without {', '.join(missing)}")
        (work / "record.json").write_text(json.dumps(record))
        # the library, then its record: a library without a (matching) record is rebuilt
        os.replace(lib, path)
        os.replace(work / "record.json", _record_path(path))
    finally:
        if not temporary:
            shutil.rmtree(work, ignore_errors=True)
    return path, True
