"""How much more memory this process may take, and which limit says so.

Three limits can stop an allocation, and the memory checks (a plan that must fit,
core/frozen_base.py; the tokenized data, training/tokenized_size.py) read all three:

- the machine: ``MemAvailable`` of /proc/meminfo (what can be had without swapping);
- the process's address space, ``RLIMIT_AS`` (``ulimit -v``), less what it maps already
  (``VmSize``: the GGUF's mapping and the libraries count);
- its cgroup's ``memory.max`` (v2; v1's ``memory.limit_in_bytes``: a container's or a
  systemd unit's limit), less what the cgroup uses now (``memory.current`` without the
  inactive file cache, which the kernel reclaims first), for the cgroup and each cgroup
  above it.

>>> usable_memory()                      # doctest: +SKIP
(3221225472, 'the cgroup limit (memory.max of /sys/fs/cgroup/user.slice)')
"""
from __future__ import annotations

import os
import re
import resource
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _status_kib(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file whose values are in kB, as bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_available() -> int | None:
    """MemAvailable of /proc/meminfo, or None where it is unknown."""
    return _status_kib("/proc/meminfo", "MemAvailable")


def address_space_left() -> int | None:
    """RLIMIT_AS less the process's mapped size now; None without such a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = _status_kib("/proc/self/status", "VmSize") or 0
    return max(soft - mapped, 0)


#: The files of a cgroup's memory limit, usage and reclaimable page cache: v2, then v1
#: (whose "no limit" is a huge number).
_CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
_NO_LIMIT = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None   # v2's "max": no limit


def _memory_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_left(root: Path = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup"
                ) -> tuple[int, Path] | None:
    """The least limit - usage over this process's memory cgroup and its ancestors (v2's
    memory.max, else v1's memory.limit_in_bytes), with the cgroup whose limit it is; None
    without a limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:   # "0::/path" (v2), "4:memory:/path" (v1)
        _, controllers, rel = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        base = root if version == "v2" else root / "memory"
        found = _least_left(base, base / rel.strip("/"), *_CGROUP_FILES[version])
        if found is not None:
            return found
    return None


def _least_left(base: Path, folder: Path, limit_file: str, usage_file: str, inactive_key: str):
    best = None
    while True:
        limit = _read_int(folder / limit_file)
        if limit is not None and limit < _NO_LIMIT:
            used = _read_int(folder / usage_file) or 0
            inactive = _memory_stat(folder / "memory.stat", inactive_key)
            left = max(limit - max(used - inactive, 0), 0)
            if best is None or left < best[0]:
                best = (left, folder)
        if folder == base or base not in folder.parents:
            return best
        folder = folder.parent


def usable_memory() -> tuple[int, str] | None:
    """(bytes, what limits it): the least of what the machine has available, what the
    address-space limit leaves and what the cgroup's limit leaves; None when none is known."""
    found = []
    machine = machine_available()
    if machine is not None:
        found.append((machine, "available on the machine"))
    space = address_space_left()
    if space is not None:
        found.append((space, "left under ulimit -v, the address-space limit"))
    cgroup = cgroup_left()
    if cgroup is not None:
        found.append((cgroup[0], f"left under the cgroup's memory.max ({cgroup[1]})"))
    return min(found, key=lambda f: f[0]) if found else None


def limit_words() -> str:
    """`` (what limits it)`` of :func:`usable_memory`, for a message; '' when unknown."""
    usable = usable_memory()
    return f" ({usable[1]})" if usable is not None else ""


def out_of_memory_text(e: MemoryError) -> str:
    """A MemoryError as one line: what the allocation needed (numpy says it: "Unable to
    allocate 3.7 GiB for an array with shape ...") and what this process may use now."""
    said = " ".join(str(e).split())
    need = re.search(r"allocate (\S+ \S+)", said)
    usable = usable_memory()
    may = (f"this process may use {usable[0] / (1 << 30):.2f} GiB ({usable[1]})"
           if usable is not None else "how much this process may use is unknown")
    what = f"needs {need.group(1)}" if need else "an allocation failed"
    detail = f" ({said[:200]})" if said else ""
    return f"out of memory: {what}{detail}; {may}"


#: numpy's ``tofile`` (the GGUF writer's) reports a short write without an errno.
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def disk_full_text(e: OSError, path=None) -> str | None:
    """"disk full writing PATH (N bytes short)" when ``e`` is a full disk or quota (ENOSPC,
    EDQUOT, or numpy's "65536 requested and 20768 written"), else None. ``path``: the
    file being written, when the error does not name it."""
    import errno
    short = _SHORT_WRITE.search(str(e))
    if e.errno not in (errno.ENOSPC, errno.EDQUOT) and short is None:
        return None
    where = path if path is not None else (e.filename or "a file")
    detail = f"{int(short[1]) - int(short[2]):,} bytes short" if short else os.strerror(e.errno)
    return f"disk full writing {where} ({detail}); free some space and run it again"
