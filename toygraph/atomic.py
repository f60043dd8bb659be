"""Writing files so that a reader never sees half of one, with the modes the user's umask
asks for; and a file's sha256, which checkpoints, data and model stores all check.

>>> atomic_write(Path("runs/x/adapter.gguf"), lambda tmp: writer.write_to(tmp))  # doctest: +SKIP

A write replaces only a regular file, or creates one (``check_replaceable``): renamed over
``/dev/null``, a FIFO or a symbolic link, the temporary file would turn the device into a
plain file (as root, the usual container user) or the link into a copy, so such a path is
refused in one line before anything is written.

Temporary files and folders come from ``tempfile``, which creates them readable by their
owner only (0600 / 0700); renamed into place they would keep that, so both helpers give
them the mode an ordinary ``open``/``mkdir`` would have had under the process's umask.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
from pathlib import Path

from toygraph.errors import ToygraphError
from toygraph.files import not_regular


class OutputPathError(ToygraphError):
    """An output path names something a write must not replace: a device, a FIFO, a
    socket, a directory or a symbolic link."""


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_replaceable(path, what: str | None = None) -> Path:
    """``path`` when a write may create or replace it: missing, or a regular file (not
    followed through a link). Else a one-line OutputPathError naming ``what`` (e.g.
    "--out") and the path."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as e:
        raise OutputPathError(f"{_named(path, what)}: cannot check it ({e.strerror or e})") from None
    if stat.S_ISLNK(mode):
        raise OutputPathError(f"{_named(path, what)} is a symbolic link (to {os.readlink(path)}); "
                              "toygraph does not write through links: give the file's own path")
    kind = not_regular(mode)
    if kind is not None:
        raise OutputPathError(f"{_named(path, what)} is {kind}, not a regular file; writing would "
                              "replace it: give a file path")
    return path


def _named(path: Path, what: str | None) -> str:
    return f"{what} {path}" if what else str(path)


def atomic_write(path, write, what: str | None = None) -> None:
    """``write(tmp_path)`` then rename over ``path``: a crash never leaves half a file.
    ``path`` must be missing or a regular file (``check_replaceable``)."""
    path = check_replaceable(path, what)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        check_replaceable(path, what)   # again: the write may have taken minutes
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def open_append(path, what: str | None = None) -> int:
    """A descriptor appending to ``path`` (created if missing), opened without following a
    symbolic link (``O_NOFOLLOW``: a linked events file in a run directory would append
    wherever it points) or blocking on a FIFO, and refused unless it is a regular file.
    Other failures are the OSError of ``open``, for the caller's own words."""
    path = Path(path)
    flags = (os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
             | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        fd = os.open(path, flags, 0o666 & ~umask())
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO, a directory
            check_replaceable(path, what)
        raise
    kind = not_regular(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise OutputPathError(f"{_named(path, what)} is {kind}, not a regular file; "
                              "give a file path")
    os.set_blocking(fd, True)
    return fd


def temp_dir(parent, prefix: str) -> Path:
    """A fresh folder in ``parent`` to fill and then rename into place, with the mode
    ``mkdir`` would give it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~umask())
    return path


def file_sha256(path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
