"""What a path must be before it is read: a regular file, never a FIFO, a device or a socket.

A FIFO blocks the reader until a writer comes (and then streams for as long as it likes);
``/dev/zero`` or ``/dev/urandom`` never end. Either hangs a command that meant to read a
file, so every path a user hands us as a file (``--config``, ``--data``, a ``json-schema:``
reward file, a run directory's lock) is checked here first, by ``stat`` -- nothing opens it
for reading before the check.

>>> check_regular_file("runs/x/run.yaml", "--config")                       # doctest: +SKIP

(toygraph/bounded.py's readers open a file without blocking and check the open descriptor
with :func:`not_regular`, so the file checked is the file read.)
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from toygraph.errors import ToygraphError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"))


def not_regular(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file ("a FIFO", ...);
    None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular_file(path, what: str, error=ToygraphError) -> Path:
    """``path`` when it names a regular file (symlinks followed), else a one-line ``error``
    naming ``what`` (the option, e.g. "--data") and the path. A missing file is left to the
    reader, which names it in its own words."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as e:
        raise error(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    kind = not_regular(mode)
    if kind is not None:
        raise error(f"{what} {path}: not a regular file ({kind}); give a file")
    return path
