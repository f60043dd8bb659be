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
import json
import math
import os
import shutil
import socket
import time
from pathlib import Path

from toygraph.bounded import parse_json
from toygraph.errors import DataError, ToygraphError

LOCK_FILE = ".lock"
EVENTS_FILE = "events.jsonl"
#: A completed run's result at the top of its directory (absent unless it completed).
FINAL_ARTIFACTS = ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf",
                   "Modelfile", "weights.safetensors")
#: One of these is at the top of every completed run (the adapter or the full weights).
RESULT_FILES = ("adapter_model.safetensors", "weights.safetensors")
#: What a run writes into its directory; ``--overwrite`` removes exactly these (tensorboard/
#: and wandb/: --report-to's, toygraph/training/reporting.py).
RUN_ARTIFACTS = (EVENTS_FILE, "checkpoints", "best", "loss.png", "tensorboard", "wandb",
                 *FINAL_ARTIFACTS)


class RunError(ToygraphError):
    """The run directory cannot be used: taken, locked, unwritable."""


def io_error(what: str, e: OSError, intact: str = "") -> RunError:
    """A one-line error for a failed write: what was written, why, and what survives."""
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
            raise RunError(f"--out {out}: {parent} is a file, not a directory")
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
    is_run = (path / EVENTS_FILE).exists() or (path / "checkpoints").exists()
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
    """An exclusive lock file holding the owner's pid, host and process start time."""

    def __init__(self, path: Path):
        self.path, self.held = path, False

    def _owner_alive(self) -> tuple[bool, str]:
        try:
            info = json.loads(self.path.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return False, "unreadable"
        if info.get("host") != socket.gethostname():
            return True, f"pid {pid} on {info.get('host')}"  # cannot check: assume alive
        alive = _alive(pid) and (info.get("start") in (None, _process_start(pid)))
        return alive, f"pid {pid}"

    def acquire(self):
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "start": _process_start(os.getpid()), "time": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                alive, who = self._owner_alive()
                if alive:
                    raise RunError(f"{self.path.parent} is in use by another run ({who}); "
                                   f"wait for it or stop it first") from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except OSError as e:
                raise io_error(f"the lock file {self.path}", e) from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me))
            self.held = True
            return
        raise RunError(f"{self.path}: could not take the run lock")

    def release(self):
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


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
        try:
            _drop_torn_tail(path)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise io_error(f"the event log {path}", e) from None

    def write(self, event: str, **fields):
        record = {"event": event, "time": round(time.time(), 3), **strict_json(fields)}
        line = (json.dumps(record, allow_nan=False) + "\n").encode()
        try:
            os.write(self.fd, line)
            for reporter in self.reporters:
                reporter.write(event, fields)
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


def _drop_torn_tail(path: Path):
    """Cut a last line that has no newline (written by a process that lost power)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


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


def is_disk_error(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EIO)
