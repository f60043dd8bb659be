"""Writing files so that a reader never sees half of one, with the modes the user's umask
asks for; and a file's sha256, which checkpoints, data and model stores all check.

>>> atomic_write(Path("runs/x/adapter.gguf"), lambda tmp: writer.write_to(tmp))  # doctest: +SKIP

Temporary files and folders come from ``tempfile``, which creates them readable by their
owner only (0600 / 0700); renamed into place they would keep that, so both helpers give
them the mode an ordinary ``open``/``mkdir`` would have had under the process's umask.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path, write) -> None:
    """``write(tmp_path)`` then rename over ``path``: a crash never leaves half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
