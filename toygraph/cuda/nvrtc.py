"""Compile CUDA C++ to a cubin with NVRTC, with a disk cache.

NVRTC needs no GPU, so CI compiles every kernel for sm_80 and sm_90. The cache key is the
sha256 of the source, the options and the NVRTC version; entries are written atomically
(temp file + os.replace) so concurrent processes never see a half-written cubin.

>>> from toygraph.cuda.nvrtc import compile_cubin
>>> cubin = compile_cubin('extern "C" __global__ void k(float* x) { x[0] = 1.f; }',
...                       arch="sm_80")                          # doctest: +SKIP
>>> cubin[:4] == b"\\x7fELF"                                      # doctest: +SKIP
True
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path

from toygraph import environment
from toygraph.errors import CudaError

logger = logging.getLogger(__name__)

_nvrtc = None

#: How many real NVRTC compilations this process ran (tests use it to see cache hits).
compile_count = 0


def bindings():
    global _nvrtc
    if _nvrtc is None:
        try:
            from cuda.bindings import nvrtc
        except Exception as e:
            raise CudaError("compiling CUDA kernels needs cuda-bindings and nvidia-cuda-nvrtc: "
                            f"pip install 'toygraph[cuda]' ({type(e).__name__}: {e})") from None
        _nvrtc = nvrtc
    return _nvrtc


def _check(what: str, res, log: str = ""):
    nv = bindings()
    status, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    if status != nv.nvrtcResult.NVRTC_SUCCESS:
        try:
            err, msg = nv.nvrtcGetErrorString(status)
            name = msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:
            name = str(status)
        raise CudaError(f"{what} failed: {name}" + (f"\n{log}" if log else ""))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that compiles."""
    try:
        res = bindings().nvrtcVersion()
    except CudaError:
        raise
    except Exception as e:  # libnvrtc missing although the bindings import
        raise CudaError(f"nvrtcVersion failed: {type(e).__name__}: {e}") from None
    major, minor = _check("nvrtcVersion", res)
    return int(major), int(minor)


def cache_dir() -> Path:
    """Where compiled kernels are cached: ``$TOYGRAPH_CACHE/kernels``."""
    return environment.cache_dir("kernels")


def options(arch: str, include_dirs=()) -> list[str]:
    if not re.fullmatch(r"sm_\d{2,3}[a-z]?", arch):
        raise CudaError(f"arch must look like 'sm_80', got {arch!r}")
    opts = ["-std=c++17", f"--gpu-architecture={arch}", "-default-device"]
    opts += [f"--include-path={d}" for d in include_dirs]
    return opts


def cache_key(source: str, opts: list[str]) -> str:
    h = hashlib.sha256()
    h.update(source.encode())
    h.update(b"\0" + "\0".join(opts).encode())
    h.update(b"\0nvrtc %d.%d" % version())
    return h.hexdigest()


def compile_cubin(source: str, arch: str, name: str = "toygraph.cu",
                  include_dirs=(), use_cache: bool = True) -> bytes:
    """Compile ``source`` for ``arch`` ("sm_80", "sm_90": a device context's ``arch``) and
    return the cubin bytes. A compile error raises CudaError with NVRTC's log. Compiling
    needs no GPU, so this module does not use the driver."""
    opts = options(arch, include_dirs)
    key = cache_key(source, opts)
    path = cache_dir() / f"{key}.cubin"
    if use_cache:
        try:
            data = path.read_bytes()
            if data:
                return data
        except OSError:
            pass
    logger.debug("compiling %s for %s with NVRTC (not in the cache %s)", name, arch, cache_dir())
    cubin = _compile(source, opts, name)
    if use_cache:
        _write_atomic(path, cubin)
    return cubin


def _compile(source: str, opts: list[str], name: str) -> bytes:
    return _run(source, opts, name)[0]


def _run(source: str, opts: list[str], name: str) -> tuple[bytes, str]:
    """One NVRTC compile: (the cubin, NVRTC's log)."""
    global compile_count
    nv = bindings()
    prog = _check("nvrtcCreateProgram",
                  nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        enc = [o.encode() for o in opts]
        res = nv.nvrtcCompileProgram(prog, len(enc), enc)
        log = _log(nv, prog)
        _check(f"NVRTC compile of {name} ({' '.join(opts)})", res, log)
        compile_count += 1
        size = _check("nvrtcGetCUBINSize", nv.nvrtcGetCUBINSize(prog))
        # A bytearray, never b" " * n: for n == 1 that is CPython's shared b" ", and
        # NVRTC writing into it would corrupt every b" " in the process.
        buf = bytearray(int(size))
        _check("nvrtcGetCUBIN", nv.nvrtcGetCUBIN(prog, buf))
        return bytes(buf), log
    finally:
        nv.nvrtcDestroyProgram(prog)


def resource_usage(source: str, arch: str, name: str = "toygraph.cu") -> dict[str, dict]:
    """Per kernel, what ptxas reports compiling ``source`` for ``arch`` (no cache, no GPU):
    ``{"registers", "stack", "spill_stores", "spill_loads", "smem"}`` (bytes of static shared
    memory). A kernel whose register
    arrays are indexed at run time or that runs out of registers shows stack / spills.

    >>> resource_usage(backend_source("f32"), "sm_90")["tg_matmul"]["spill_stores"]  # doctest: +SKIP
    0
    """
    return compile_report(source, arch, name)[1]


def compile_report(source: str, arch: str, name: str = "toygraph.cu") -> tuple[bytes, dict]:
    """The cubin of ``source`` for ``arch`` and ptxas's report of it (:func:`resource_usage`),
    from one compile (no cache): a whole module's report costs no second compile."""
    cubin, log = _run(source, options(arch) + ["--ptxas-options=-v"], name)
    return cubin, _ptxas_report(log)


def _ptxas_report(log: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    kernel = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            kernel = m.group(1)
            out[kernel] = {"registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0,
                           "smem": 0}
            continue
        if kernel is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", line)
        if m:
            out[kernel].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                               spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[kernel]["registers"] = int(m.group(1))
            m = re.search(r"(\d+) bytes smem", line)
            out[kernel]["smem"] = int(m.group(1)) if m else 0
    return out


def _log(nv, prog) -> str:
    try:
        size = _check("nvrtcGetProgramLogSize", nv.nvrtcGetProgramLogSize(prog))
        buf = bytearray(int(size))  # writable, never a shared bytes object (see above)
        _check("nvrtcGetProgramLog", nv.nvrtcGetProgramLog(prog, buf))
        return buf.rstrip(b"\0 ").decode(errors="replace")
    except CudaError:
        return ""


def _write_atomic(path: Path, data: bytes) -> None:
    """Best effort: a read-only cache directory only costs a recompile next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        pass
