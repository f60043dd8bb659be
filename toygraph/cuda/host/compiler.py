"""Compile the CUDA kernel sources as host C++ (g++) into a shared library, with a disk cache.

The library is the same translation unit NVRTC compiles (sources.backend_source), with
``TG_HOST`` defined and host_shim.h in front, which supplies threadIdx & co, barriers,
warp shuffles, mma.sync and the cvt roundings; one ``tg_host_launch_<kernel>`` entry is
appended per kernel (sources.kernel_names, which reads the kernels a TG_BLOCK_FORMATS line
defines per block format from the X-macro's expansion). device.py loads it and launches
kernels over host memory.

The cache key is the sha256 of the full host source, the flags and ``g++ --version``; the
library lives in ``$TOYGRAPH_CACHE/kernels/host`` (the folder nvrtc.py caches cubins in, plus
``host``) and is written atomically (temp file + os.replace).

>>> from toygraph.cuda.host.compiler import build_library
>>> path = build_library(backend_source("f32"))          # doctest: +SKIP
"""
from __future__ import annotations

import logging
import platform
from functools import lru_cache
from pathlib import Path

from toygraph import environment, native
from toygraph.ops.lowering.sources import INCLUDE_DIR, kernel_names
from toygraph.cuda.nvrtc import cache_dir
from toygraph.errors import CudaError

logger = logging.getLogger(__name__)

SHIM = INCLUDE_DIR / "host_shim.h"   # the CUDA builtins in C++, beside the kernel headers
#: -O1 builds the whole kernel module about twice as fast as -O2; the kernels then run a
#: little slower, which small test shapes do not notice (see bench/README.md); hence the
#: default of ``$TOYGRAPH_HOST_OPT`` (toygraph/environment.py), read at each build.
#: No FMA contraction (the kernels' __f*_rn must stay single operations, as on the GPU);
#: no strict aliasing (the tensor-core kernels read bf16 pairs through unsigned*).
FLAGS = ("-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
         "-fno-strict-aliasing", "-fvisibility=hidden", "-w")

#: How many real g++ builds this process ran (tests use it to see cache hits).
build_count = 0


def compiler() -> str:
    """The host C++ compiler (``$CXX``, else g++), or CudaError saying how to get one."""
    cxx = native.compiler()
    if not cxx:
        raise CudaError("the host executor compiles the CUDA kernels with g++, which is not "
                        "installed (apt-get install g++, or set CXX)")
    return cxx


@lru_cache(maxsize=None)
def _cpu_flags() -> tuple[str, ...]:
    """-mfma where the CPU has it: the kernels' fmaf becomes one instruction instead of a
    libm call (which dominates the matmuls' time); the result is the same fused op."""
    try:
        with open("/proc/cpuinfo") as f:
            has_fma = any(line.startswith("flags") and " fma" in line for line in f)
    except OSError:
        has_fma = False
    return ("-mfma",) if has_fma and platform.machine() == "x86_64" else ()


def host_source(source: str) -> str:
    """``source`` (CUDA C++ as NVRTC gets it) as one host translation unit."""
    exports = "".join(f"TG_HOST_EXPORT({k})\n" for k in kernel_names(source))
    return ("#define TG_HOST 1\n" + SHIM.read_text() + "\n#line 1 \"toygraph.cu\"\n" + source
            + "\n// ---- host entry points\n" + exports)


def build_library(source: str, opt: str | None = None, use_cache: bool = True) -> Path:
    """The path of the shared library of ``source``, compiling it on a cache miss. A compile
    error raises CudaError with the compiler's log."""
    global build_count
    cxx = compiler()
    flags = [opt or environment.get("TOYGRAPH_HOST_OPT"), *FLAGS, *_cpu_flags()]
    logger.debug("building the host kernel library with %s %s", cxx, " ".join(flags))
    path, built = native.build_shared(host_source(source), flags, cache_dir() / "host",
                                      "the CUDA kernels", cxx=cxx, use_cache=use_cache,
                                      error=CudaError)
    build_count += built
    return path
