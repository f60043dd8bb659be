"""The run directory: who may write into it (a lock), and its event log.

A run directory holds one training run. ``open_run_dir`` refuses a directory that already
holds another run unless the caller resumes it or asks to overwrite it, and takes a lock
file so that two processes never write into one run at once (a lock whose process is
gone is stale and taken over). ``EventLog`` appends one strict-JSON object a line, each
line in a single ``write`` so a killed process never leaves half a line behind;
``read_events`` still skips a torn last line (a power loss can leave one).
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import socket
import time
from pathlib import Path

from toygraph.atomic import open_append
from toygraph.bounded import parse_json
from toygraph.errors import DataError, ToygraphError
from toygraph.files import not_regular
from toygraph.limits import disk_full_text

LOCK_FILE = ".lock"
EVENTS_FILE = "events.jsonl"
#: A completed run's result at the top of its directory (absent unless it completed).
FINAL_ARTIFACTS = ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf",
                   "Modelfile", "weights.safetensors")
#: One of these is at the top of every completed run (the adapter or the full weights).
RESULT_FILES = ("adapter_model.safetensors", "weights.safetensors")
#: The run's id (lineage.py), the checkpoints a resume from an earlier step set aside
#: (lineage.py), and a finished run's result while an extension of it trains (result.py).
RUN_ID_FILE, SUPERSEDED, RESULT_ASIDE = "run_id", "superseded", ".previous-result"
#: What a run writes into its directory; ``--overwrite`` removes exactly these (tensorboard/
#: and wandb/: --report-to's, toygraph/training/reporting.py).
RUN_ARTIFACTS = (EVENTS_FILE, "checkpoints", "best", "loss.png", "tensorboard", "wandb",
                 RUN_ID_FILE, SUPERSEDED, RESULT_ASIDE, *FINAL_ARTIFACTS)


class RunError(ToygraphError):
    """The run directory cannot be used: taken, locked, unwritable."""


def io_error(what: str, e: OSError, intact: str = "") -> RunError:
    """A one-line error for a failed write: what was written, why, and what survives."""
    full = disk_full_text(e, what)
    if full is not None:
        return RunError(full + (f"; {intact}" if intact else ""))
    reason = os.strerror(e.errno) if e.errno else str(e)
    return RunError(f"could not write {what}: {reason}" + (f"; {intact}" if intact else ""))


# --- the directory -----------------------------------------------------------------------------
def check_out_path(out: str) -> Path:
    """``--out`` must name a directory we can create or write in, not a file or below one."""
    if not out or not out.strip():
        raise RunError("--out must name a directory, got an empty string")
    path = Path(out)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            kind = not_regular(parent.stat().st_mode) or "a file"
            raise RunError(f"--out {out}: {parent} is {kind}, not a directory")
        if parent.exists():
            if not os.access(parent, os.W_OK | os.X_OK):
                raise RunError(f"--out {out}: {parent} is not writable")
            break
    return path


def check_run_dir(out: str, *, resume: bool, overwrite: bool) -> Path:
    """What opening ``out`` as a run directory would refuse, found without writing: a path
    that is no usable directory, or one that holds a run (or anything) without --resume
    or --overwrite."""
    path = check_out_path(out)
    is_run = any((path / name).exists() for name in (EVENTS_FILE, "checkpoints", RUN_ID_FILE))
    if path.is_dir() and any(path.iterdir()) and not (resume or overwrite):
        what = "holds a run" if is_run else "is not empty"
        raise RunError(f"--out {out} {what}; pass --resume {out} to continue it, --overwrite "
                       f"to replace it, or choose another --out")
    return path


def open_run_dir(out: str, *, resume: bool, overwrite: bool) -> tuple[Path, "RunLock"]:
    """Create or reopen the run directory and lock it; returns (path, lock)."""
    path = check_run_dir(out, resume=resume, overwrite=overwrite)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise io_error(f"the run directory {out}", e) from None
    lock = RunLock(path / LOCK_FILE)
    lock.acquire()
    if overwrite and not resume:
        try:
            for name in RUN_ARTIFACTS:
                victim = path / name
                if victim.is_dir():
                    shutil.rmtree(victim)
                elif victim.exists():
                    victim.unlink()
        except OSError as e:
            lock.release()
            raise io_error(f"(clearing) {out} for --overwrite", e) from None
    return path, lock


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), so a recycled pid is not taken for ours."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The run directory's lock: an ``flock`` on ``.lock`` held for the run's life.

    The kernel drops an flock when its process dies, so a lock left by a killed run is free
    to take, and taking it is one atomic call: two runs racing for a stale lock cannot both
    win (reading, unlinking and re-creating the file, the way an ``O_EXCL`` lock has to take
    over, is three calls another run can interleave with). The file holds the owner's pid,
    host and start time, for the error a second run gets. A lock file written by a process
    that held no flock (an older toygraph) still counts while that process lives.
    Releasing unlinks the file while still holding the lock; a run that opened the old file
    in the meantime sees, once it holds the lock, that the path now names another file (or
    none), and tries again on the new one."""

    def __init__(self, path: Path):
        self.path, self.held, self.fd = path, False, None

    def _owner(self, fd: int) -> tuple[bool, str]:
        """(whether the owner named in the file is alive, who it is) from the open lock."""
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"null")
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return False, "unreadable"
        if info.get("host") != socket.gethostname():
            return True, f"pid {pid} on {info.get('host')}"  # cannot check: assume alive
        alive = (pid != os.getpid() and _alive(pid)
                 and info.get("start") in (None, _process_start(pid)))
        return alive, f"pid {pid}"

    def _open(self) -> int:
        """The lock file, opened (created if missing) without following a link or blocking
        on a FIFO, and refused unless it is a regular file."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunError(f"the lock file {self.path} is a symbolic link; remove it") from None
            raise io_error(f"the lock file {self.path}", e) from None
        kind = not_regular(os.fstat(fd).st_mode)
        if kind is not None:
            os.close(fd)
            raise RunError(f"the lock file {self.path} is {kind}, not a regular file; remove it")
        return fd

    def acquire(self):
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "start": _process_start(os.getpid()), "time": time.time()}
        for _ in range(100):   # each retry means another run released the lock meanwhile
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                _, who = self._owner(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunError(f"{self.path.parent} is in use by another run ({who}); "
                                   f"wait for it or stop it first") from None
                raise io_error(f"the lock file {self.path}", e) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if not same:   # released (unlinked) by its owner after we opened it
                os.close(fd)
                continue
            alive, who = self._owner(fd)
            if alive:   # a lock of a process that holds no flock (an older toygraph)
                os.close(fd)
                raise RunError(f"{self.path.parent} is in use by another run ({who}); "
                               f"wait for it or stop it first")
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me).encode(), 0)
            except OSError as e:
                os.close(fd)
                raise io_error(f"the lock file {self.path}", e) from None
            self.fd, self.held = fd, True
            return
        raise RunError(f"{self.path}: could not take the run lock (it kept changing hands)")

    def release(self):
        if self.held:
            self.path.unlink(missing_ok=True)   # while still holding it: see the class doc
            os.close(self.fd)
            self.fd, self.held = None, False


# --- events ------------------------------------------------------------------------------------
def strict_json(fields: dict) -> dict:
    """Replace non-finite floats by null and name them under ``nonfinite`` (strict JSON
    has no NaN or Infinity)."""
    bad = [k for k, v in fields.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return fields
    out = {k: (None if k in bad else v) for k, v in fields.items()}
    out["nonfinite"] = {k: repr(fields[k]) for k in bad}
    return out


class EventLog:
    """Appends one JSON object a line, each in one ``write`` call (O_APPEND), so a crash
    or kill loses at most the line being written and never leaves a partial one. Each of
    ``reporters`` (--report-to: toygraph/training/reporting.py) is handed every event
    after it is written, and closed with the log."""

    def __init__(self, path: Path, reporters=()):
        self.path, self.reporters = path, list(reporters)
        try:   # never through a link, nor into a FIFO or device (open_append)
            self.fd = open_append(path, "the event log")
            _drop_torn_tail(self.fd)
        except OSError as e:
            raise io_error(f"the event log {path}", e) from None

    def write(self, event: str, **fields):
        self.write_line(event, **fields)
        try:
            for reporter in self.reporters:
                reporter.write(event, fields)
        except OSError as e:
            raise io_error(f"the event log {self.path}", e) from None

    def write_line(self, event: str, **fields):
        """The event's line in the log alone (``write`` also hands it to the reporters;
        a process about to end, bus_error.py, writes only this)."""
        record = {"event": event, "time": round(time.time(), 3), **strict_json(fields)}
        line = (json.dumps(record, allow_nan=False) + "\n").encode()
        try:
            os.write(self.fd, line)
        except OSError as e:
            raise io_error(f"the event log {self.path}", e) from None

    def close(self):
        while self.reporters:
            self.reporters.pop().close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class NullLog:
    """The event log of a data-parallel rank other than 0: rank 0 alone writes events."""

    def write(self, event: str, **fields):
        pass

    def close(self):
        pass


def _drop_torn_tail(fd: int):
    """Cut a last line that has no newline (written by a process that lost power), in the
    open log ``fd`` (the file checked is the file cut)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    data = os.pread(fd, size, 0)
    os.ftruncate(fd, data.rfind(b"\n") + 1)


def read_events(path: Path) -> list[dict]:
    """Every complete event of a run's log; a torn or undecodable last line is skipped."""
    try:
        lines = Path(path).read_bytes().split(b"\n")
    except FileNotFoundError:
        return []
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:   # bounded: a deeply nested line is refused, never a RecursionError
            out.append(parse_json(line.decode("utf-8", "replace"), f"{path}:{i + 1}"))
        except DataError:
            if i < len(lines) - 1 and any(x.strip() for x in lines[i + 1:]):
                raise RunError(f"{path}:{i + 1}: not a JSON event") from None
    return out

