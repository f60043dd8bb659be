"""A file truncated under the run's memory mapping: a one-line error, not a dead process.

The base model is memory-mapped, and its frozen weights are read from the mapping at
every step. When the file is truncated meanwhile (rewritten in place, a download started
over), the next read of a page past its new end raises SIGBUS, which kills the process:
exit 135, no error line, no ``run_end``. Python cannot turn SIGBUS into an exception (its
own handler only notes the signal, returns, and the read faults again, forever), and
nothing after the fault may go on computing with half a model. So ``BusErrorGuard`` puts a
handler of its own (a ctypes callback, through ``sigaction``) on SIGBUS for the run's
duration, which never returns: it finds which watched file changed (its size, inode and
mtime against the ones it had when the guard was armed), says so on one line, lets the
run record its end (``last_words``: the ``run_end`` event, the lock), and exits with
status 2. Everything the run wrote is atomic, so its checkpoints stay resumable.

The handler runs Python code inside a signal handler. That is sound here because the
fault is synchronous -- a read of mapped memory inside numpy's code, never inside the
allocator or the interpreter's own bookkeeping -- and the process ends right after.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

#: The exit status after a bus error (the command line's status for an error).
EXIT_STATUS = 2


class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` (x86-64 and arm64 Linux)."""
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


def _identity(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns


def what_changed(path: Path, was: tuple) -> str | None:
    """How ``path`` differs from the identity ``was`` (size, device, inode, mtime), or None."""
    now = _identity(path)
    if now is None:
        return "was deleted"
    if now[0] < was[0]:
        return f"was truncated to {now[0]:,} bytes (it had {was[0]:,})"
    if now[1:3] != was[1:3]:
        return "was replaced by another file"
    if now != was:
        return "was rewritten"
    return None


class BusErrorGuard:
    """``with BusErrorGuard(files, what, last_words):`` -- a SIGBUS in the block ends the
    process with one line naming the changed file of ``files`` (``what`` names the
    command: "toygraph finetune"), after ``last_words(reason)`` (each one called, errors
    ignored: the process is ending). Armed only in the main thread on Linux; elsewhere a
    plain context."""

    def __init__(self, files, what: str = "toygraph", resume_hint: str = ""):
        self.files = {Path(f): _identity(Path(f)) for f in files}
        self.what, self.resume_hint = what, resume_hint
        self.last_words: list = []
        self._old = None
        self._callback = _HANDLER(self._on_bus_error)   # kept alive while armed

    def reason(self) -> str:
        for path, was in self.files.items():
            change = was is not None and what_changed(path, was)
            if change:
                return f"{path} {change} while this run had it mapped (SIGBUS)"
        names = ", ".join(str(p) for p in self.files)
        return f"a bus error (SIGBUS) reading a memory-mapped file ({names} unchanged)"

    def _on_bus_error(self, signum):
        try:
            reason = self.reason()
            for words in self.last_words:
                try:
                    words(reason)
                except BaseException:   # the process ends either way
                    pass
            os.write(2, f"{self.what}: error: {reason}{self.resume_hint}\n".encode(
                "utf-8", "replace"))
        finally:
            os._exit(EXIT_STATUS)

    def __enter__(self):
        if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
            return self
        libc = ctypes.CDLL(None, use_errno=True)
        new, old = _Sigaction(), _Sigaction()
        new.handler = ctypes.cast(self._callback, ctypes.c_void_p)
        if libc.sigaction(signal.SIGBUS, ctypes.byref(new), ctypes.byref(old)) == 0:
            self._libc, self._old = libc, old
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            self._libc.sigaction(signal.SIGBUS, ctypes.byref(self._old), None)
            self._old = None
