"""How many threads toygraph computes with (engine.use_threads sets them for the CPU
engine's pool and, through :func:`limit_blas`, for BLAS's, so decoders, kernels and numpy's
GEMMs never run more threads than the process may use).

The count is ``--threads`` (every command has it), else ``$TOYGRAPH_THREADS``, else the CPUs
this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit, not
the machine's core count). A count past those CPUs is capped to them, said once in one line:
more threads than cores only contend for them, and ``--threads 32399`` once started 32,399.

>>> resolve(None)    # on a 2-core machine, nothing set         # doctest: +SKIP
2
"""
from __future__ import annotations

import logging
import os

from toygraph import environment
from toygraph.errors import SettingError

logger = logging.getLogger(__name__)


def allowed_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve(n: int | None) -> int:
    """``n``, else ``$TOYGRAPH_THREADS``, else :func:`allowed_cpus`, capped to
    :func:`allowed_cpus` (with a warning naming the flag or the variable); a SettingError
    names a count below 1."""
    source = "--threads {}"
    if n is None:
        n = environment.get("TOYGRAPH_THREADS")
        source = "TOYGRAPH_THREADS={}"
    if n is None:
        return allowed_cpus()
    n = int(n)
    if n < 1:
        raise SettingError(f"--threads must be at least 1, got {n}")
    return _capped(n, source.format(n))


_warned: set[str] = set()   # the capped counts said already (resolve runs for every step)


def _capped(n: int, given: str) -> int:
    allowed = allowed_cpus()
    if n <= allowed:
        return n
    if given not in _warned:
        _warned.add(given)
        logger.warning("%s is more than the %d CPUs this process may use: computing with %d",
                       given, allowed, allowed)
    return allowed


_chosen: int | None = None      # what engine.use_threads was last given (resolved)
_blas_now: int | None = None    # what BLAS was last limited to here
_blas_limits = None


def chosen() -> int:
    """The threads to compute with: the count engine.use_threads set, else the default."""
    return _chosen if _chosen is not None else resolve(None)


def choose(n: int) -> None:
    global _chosen
    _chosen = n


def limit_blas(n: int) -> None:
    """Limit BLAS's pools to ``n`` threads through threadpoolctl (a dependency; without it,
    BLAS keeps its own count). Nothing is done when BLAS has that count already."""
    global _blas_limits, _blas_now
    if n == _blas_now:
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    if _blas_limits is not None:
        _blas_limits.restore_original_limits()
    _blas_limits = threadpool_limits(limits=n, user_api="blas")
    _blas_now = n


def blas_beside_engine(engine_carries: bool) -> None:
    """BLAS's threads for a step: one when the engine carries the heavy products (a base
    in blocks), so BLAS's pool never spins beside the engine's on the same cores; all of
    them when BLAS multiplies the base itself. Measured on 2 cores, SmolLM2 LoRA 4 x 64
    (bench/cpu_engine.py's A/B, interleaved steps): blocks with BLAS at 2 threads 2.66 s
    a step, at 1 thread 1.80 s, against 1.68 s decoded."""
    limit_blas(1 if engine_carries else chosen())
