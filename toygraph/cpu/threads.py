"""How many threads toygraph computes with (engine.use_threads sets them for the CPU
engine's pool and, through :func:`limit_blas`, for BLAS's, so decoders, kernels and numpy's
GEMMs never run more threads than the process may use).

The count is ``--threads`` (every command has it), else ``$TOYGRAPH_THREADS``, else the CPUs
this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit, not
the machine's core count).

>>> resolve(None)    # on a 2-core machine, nothing set         # doctest: +SKIP
2
"""
from __future__ import annotations

import os

from toygraph import environment
from toygraph.errors import SettingError


def allowed_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve(n: int | None) -> int:
    """``n``, else ``$TOYGRAPH_THREADS``, else :func:`allowed_cpus`; a SettingError names a
    count below 1."""
    if n is None:
        n = environment.get("TOYGRAPH_THREADS") or allowed_cpus()
    n = int(n)
    if n < 1:
        raise SettingError(f"--threads must be at least 1, got {n}")
    return n


_blas_limits = None


def limit_blas(n: int) -> None:
    """Limit BLAS's pools to ``n`` threads through threadpoolctl (a dependency; without it,
    BLAS keeps its own count)."""
    global _blas_limits
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    if _blas_limits is not None:
        _blas_limits.restore_original_limits()
    _blas_limits = threadpool_limits(limits=n, user_api="blas")
