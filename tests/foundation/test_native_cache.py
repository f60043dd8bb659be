"""The native build cache is verified, not trusted (issue 46 item 3): a cached library is
loaded only when its record (size, sha256, symbols) vouches for it; a damaged, truncated,
empty or foreign one is rebuilt with one line; a compile has a time limit and says what it
does when slow; a cache that cannot be written builds in a temporary folder removed at
exit. A tiny source keeps every build a fraction of a second."""
import ctypes
import logging
import os
import random
import shutil
import stat
import time

import pytest

from toygraph import native
from toygraph.errors import ToygraphError

SOURCE = 'extern "C" int tg_answer() { return 42; }\n'
OTHER = 'extern "C" int tg_other() { return 7; }\nextern "C" int tg_answer() { return 6; }\n'
FLAGS = ["-O1", "-shared", "-fPIC"]

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")


def build(folder, source=SOURCE, **kw):
    return native.build_shared(source, FLAGS, folder, "the test library", **kw)


def answer(path) -> int:
    lib = ctypes.CDLL(str(path))
    return lib.tg_answer()


def rebuilt_lines(caplog):
    return [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]


def test_a_build_is_recorded_and_then_found(tmp_path):
    path, built = build(tmp_path)
    assert built and answer(path) == 42
    record = native._record_path(path)
    assert record.is_file() and native.cached_problem(path, ("tg_answer",)) is None
    assert build(tmp_path) == (path, False)
    assert "tg_answer" in native.elf_symbols(path)


def _truncate(path, rng):
    data = path.read_bytes()
    path.write_bytes(data[:rng.randrange(1, len(data))])


def _flip(path, rng):
    data = bytearray(path.read_bytes())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _empty(path, rng):
    path.write_bytes(b"")


def _garbage(path, rng):
    path.write_bytes(bytes(rng.randrange(256) for _ in range(path.stat().st_size)))


def _foreign(path, rng):
    """Another library of ours (other source) copied over it: same kind of file, wrong one."""
    other, _ = build(path.parent / "other", OTHER)
    shutil.copyfile(other, path)


def _no_record(path, rng):
    native._record_path(path).unlink()


def _bad_record(path, rng):
    native._record_path(path).write_text("{not json")


def _fifo_record(path, rng):
    native._record_path(path).unlink()
    os.mkfifo(native._record_path(path))


DAMAGE = {"truncated": _truncate, "bit flip": _flip, "empty": _empty, "garbage": _garbage,
          "foreign": _foreign, "no record": _no_record, "bad record": _bad_record,
          "fifo record": _fifo_record}


#: every kind once, and the random ones at a second place
CASES = [(kind, 0) for kind in DAMAGE] + [("truncated", 1), ("bit flip", 1)]


@pytest.mark.parametrize("kind,seed", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_a_damaged_cached_library_is_rebuilt_in_one_line_never_loaded(tmp_path, caplog, kind,
                                                                      seed):
    """The fuzz of damaged caches: each kind of damage, at random places, is found before
    the library is loaded, said in one line, and the library built again works."""
    path, _ = build(tmp_path)
    DAMAGE[kind](path, random.Random(seed))
    assert native.cached_problem(path, ("tg_answer",)) is not None
    with caplog.at_level(logging.WARNING, logger="toygraph.native"):
        again, built = build(tmp_path)
    assert (again, built) == (path, True)
    lines = rebuilt_lines(caplog)
    assert len(lines) == 1 and str(path) in lines[0] and "\n" not in lines[0], lines
    assert answer(path) == 42 and native.cached_problem(path, ("tg_answer",)) is None


def test_a_cached_library_without_a_needed_symbol_is_not_used(tmp_path):
    path, _ = build(tmp_path)
    assert native.cached_problem(path, ("tg_answer", "tg_matmul")) == "lacks tg_matmul"
    with pytest.raises(ToygraphError, match="made a library without tg_matmul"):
        build(tmp_path, symbols=("tg_answer", "tg_matmul"))


def test_a_cached_library_that_is_a_directory_is_not_loaded(tmp_path):
    path, _ = build(tmp_path)
    path.unlink()
    path.mkdir()
    assert native.cached_problem(path) == "is a directory, not a library"


@pytest.fixture
def slow_compiler(tmp_path):
    """A "compiler" that answers --version at once and otherwise hangs (in a child, as
    g++'s cc1plus is), writing its pid so the test can see it was killed."""
    script = tmp_path / "hung-g++"
    pids = tmp_path / "pids"
    script.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo hung 1.0; exit 0; }\n"
                      f"sleep 60 & echo $! > {pids}\nwait\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, pids


def test_a_hung_compiler_is_stopped_at_the_time_limit_and_said(tmp_path, monkeypatch, caplog,
                                                               slow_compiler):
    script, pids = slow_compiler
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 1.5)
    monkeypatch.setattr(native, "SAY_AFTER_S", 0.2)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="toygraph.native"), \
            pytest.raises(ToygraphError, match="did not finish in 1.5 s"):
        build(tmp_path / "cache", cxx=str(script), say=True)
    assert time.monotonic() - t0 < 20
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("building the test library with") and "up to 1.5 s" in m
               for m in said), said
    child = int(pids.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.05)
    assert not _running(child), "the compiler's child outlived the time limit"
    assert not list((tmp_path / "cache").glob(".build-*"))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_cache_that_cannot_be_written_builds_in_a_temporary_folder_removed_at_exit(
        tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")   # the cache lies under a file: it can never be created
    cleanups = []
    monkeypatch.setattr(native.atexit, "register", lambda fn, *a: cleanups.append((fn, a)))
    with caplog.at_level(logging.WARNING, logger="toygraph.native"):
        path, built = build(blocker / "kernels")
    assert built and answer(path) == 42 and path.parent.name.startswith("toygraph-native-")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cannot be written" in said[0] and "removed when" in said[0]
    for fn, args in cleanups:
        fn(*args)
    assert not path.parent.exists()


def test_the_cpu_engine_names_its_entry_points():
    """engine.SYMBOLS is what engine.load types; a library lacking one is not loaded."""
    from toygraph.cpu import engine
    text = (engine.HERE / "engine.cpp").read_text()
    exported = {line.split("(")[0].split()[-1].lstrip("*")
                for line in text.splitlines() if line.startswith("TG_EXPORT")}
    assert exported == set(engine.SYMBOLS)
