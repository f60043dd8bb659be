"""Which run a run directory holds: its run id, and what a resume may do to it.

A run gets an id at its first start; the run directory keeps it (``run_id``) and every
checkpoint's state records it (``LoopState.run_id``). A resume continues its checkpoint's
run: into that run's own directory (or one that holds no run yet: then as a new run, a
branch, with an id of its own), never into a directory that holds another run -- that would
replace the other run's result and ``best/`` and let the two runs' checkpoints prune each
other. Checkpoints of the run newer than the one resumed from are its earlier course, not
this one's: they are moved to ``superseded/`` and said, so that neither a later resume nor
the pruning takes them for the newest of the run.
"""
from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from toygraph.atomic import atomic_write, check_replaceable
from toygraph.training.checkpoints import checkpoint_run_id, list_checkpoints
from toygraph.training.run_dir import (EVENTS_FILE, RUN_ID_FILE, SUPERSEDED, RunError,
                                       io_error)

_ID = re.compile(r"[0-9a-f]{32}")


def new_run_id() -> str:
    return uuid.uuid4().hex


def holds_run(out: Path) -> bool:
    return any((Path(out) / name).exists() for name in (EVENTS_FILE, "checkpoints", RUN_ID_FILE))


def directory_run_id(out: Path) -> str | None:
    """The id of the run ``out`` holds: its ``run_id`` file, or for a directory written
    before runs had ids (or whose file was lost) the id its newest checkpoint or ``best/``
    records; None when none is known."""
    out = Path(out)
    f = check_replaceable(out / RUN_ID_FILE)   # a FIFO would hang the read; a link, mislead
    if f.exists():
        try:
            text = f.read_text(encoding="ascii", errors="replace").strip()
        except OSError as e:
            raise io_error(f"(reading) {f}", e) from None
        if not _ID.fullmatch(text):
            raise RunError(f"{f}: not a run id (32 hex digits); it names the run the directory "
                           f"holds, so remove it only if you know which run that is")
        return text
    for ck in [p for _, p in reversed(list_checkpoints(out))] + [out / "best"]:
        run_id = checkpoint_run_id(ck)
        if run_id is not None:
            return run_id
    return None


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


def lineage(out: Path, resume_from: Path | None, resumed_id: str | None) -> tuple[str, str | None]:
    """(the run id this start runs under, the id ``out`` must still hold when it is locked:
    None for a directory that holds no run). ``resumed_id``: the id the checkpoint
    ``resume_from`` records (None: none, or not resuming). Refuses, in one line, a resume
    into a directory that holds another run."""
    out = Path(out)
    if not holds_run(out):   # a new run, or a branch of the resumed one: an id of its own
        return new_run_id(), None
    there = directory_run_id(out)
    if resume_from is None:   # --overwrite: the directory's run is replaced
        return new_run_id(), there
    if there is not None and resumed_id is not None and there != resumed_id:
        raise RunError(f"--resume {resume_from} --out {out}: {out} holds another run (run id "
                       f"{there[:8]}), the checkpoint is of run {resumed_id[:8]}; resuming it "
                       f"there would replace that run's result and mix the two runs' "
                       f"checkpoints. Choose a new --out, or --resume {out} to continue the "
                       f"run it holds")
    if (there is None or resumed_id is None) and not _inside(resume_from, out):
        raise RunError(f"--resume {resume_from} --out {out}: {out} holds a run that cannot be "
                       f"told apart from another (no run id recorded), and the checkpoint is "
                       f"not one of its own; choose a new --out, or --resume {out} to continue "
                       f"the run it holds")
    return there or resumed_id or new_run_id(), there


def check_claim(out: Path, expected: str | None) -> None:
    """Under the run's lock: ``out`` must still hold the run ``lineage`` found there
    (another process may have started one since)."""
    now = directory_run_id(out) if holds_run(out) else None
    if now != expected:
        raise RunError(f"{out}: another run (run id {str(now)[:8]}) started there meanwhile; "
                       f"choose another --out")


def record_run_id(out: Path, run_id: str) -> None:
    """Write ``run_id`` into ``out`` (when the run starts: its first event follows)."""
    f = Path(out) / RUN_ID_FILE
    try:
        if f.exists() and f.read_text().strip() == run_id:
            return
        atomic_write(f, lambda tmp: Path(tmp).write_text(run_id + "\n"))
    except OSError as e:
        raise io_error(f"the run id into {out}", e) from None


def set_aside_newer(out: Path, step: int, run_id: str) -> list[str]:
    """Move the run's checkpoints newer than ``step`` to ``out/superseded/``: they are the
    run's earlier course, which a resume from ``step`` replaces; left in place, a later
    resume would take them for the newest and pruning would delete this course's instead.
    (``best/`` stays: it is the lowest validation loss of the run, whichever course.)
    Returns the names moved, for the user."""
    out = Path(out)
    moved = []
    for s, path in list_checkpoints(out):
        if s <= step or checkpoint_run_id(path) not in (run_id, None):
            continue
        dest, n = out / SUPERSEDED / path.name, 1
        while dest.exists():
            dest, n = out / SUPERSEDED / f"{path.name}.{n}", n + 1
        try:
            dest.parent.mkdir(exist_ok=True)
            os.replace(path, dest)
        except OSError as e:
            raise io_error(f"(moving aside) {path}", e, "nothing was trained yet") from None
        moved.append(path.name)
    return moved
