"""toygraph/cpu/threads.py and ``--threads``: one count for the engine's pool and BLAS's,
from the flag, $TOYGRAPH_THREADS or the CPUs this process may use; every command that
computes has the flag."""
import os

import numpy as np
import pytest

from toygraph.cli.main import WITHOUT_COMPUTE, build_parser, main
from toygraph.cpu import engine, threads
from toygraph.errors import SettingError, ToygraphError


@pytest.fixture(autouse=True)
def restore():
    yield
    engine.use_threads(None)


def test_the_count_comes_from_the_flag_the_variable_or_the_allowed_cpus(monkeypatch):
    monkeypatch.delenv("TOYGRAPH_THREADS", raising=False)
    assert threads.resolve(None) == len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "allowed_cpus", lambda: 8)
    monkeypatch.setenv("TOYGRAPH_THREADS", "3")
    assert threads.resolve(None) == 3 and threads.resolve(5) == 5
    monkeypatch.setenv("TOYGRAPH_THREADS", "0")
    with pytest.raises(SettingError, match="TOYGRAPH_THREADS"):
        threads.resolve(None)
    with pytest.raises(SettingError, match="--threads must be at least 1"):
        threads.resolve(0)


def test_use_threads_sizes_the_engine_and_blas(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    monkeypatch.setattr(threads, "allowed_cpus", lambda: 8)   # 3 threads on any machine
    if engine.library() is None:
        pytest.skip("no host C++ compiler")
    assert engine.use_threads(3) == 3 and engine.library().tg_threads() == 3
    blas = [p for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    assert blas and all(p["num_threads"] == 3 for p in blas)
    assert engine.use_threads(1) == 1 and engine.library().tg_threads() == 1
    assert all(p["num_threads"] == 1 for p in threadpoolctl.threadpool_info()
               if p["user_api"] == "blas")


def test_every_command_that_computes_takes_threads():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        has = any(a.dest == "threads" for a in parser._actions)
        assert has == (name not in WITHOUT_COMPUTE), name


def test_a_bad_count_is_one_line(capsys):
    assert main(["eval", "--model", "nothing.gguf", "--text", "x", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads must be at least 1" in err


def test_a_fork_child_computes_without_the_parents_workers():
    """The pool's workers do not survive fork(); the child's products still run (on the
    caller alone) instead of waiting for them."""
    if engine.library() is None:
        pytest.skip("no host C++ compiler")
    from toygraph.gguf import block_encode
    engine.use_threads(2)
    w = block_encode.quantize(np.ones((64, 64), np.float32), "q8_0")
    x = np.ones((20, 64), np.float32)
    want = engine.matmul_nt(x, w, "q8_0", (64, 64), np.empty((20, 64), np.float32))
    pid = os.fork()
    if pid == 0:   # the child: exit 0 only if the product finishes and is the parent's
        y = engine.matmul_nt(x, w, "q8_0", (64, 64), np.empty((20, 64), np.float32))
        os._exit(0 if np.array_equal(y, want) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("count", [99999999999, 2**32 + 1])
def test_more_threads_than_the_cpus_allowed_are_capped_in_one_line(count, monkeypatch, caplog):
    """A count past the CPUs this process may use (the flag or the variable, parsed as a
    whole number of any size: 2^32 + 1 once wrapped to 1 on its way to the engine) is capped
    to those CPUs, said in one line naming where it came from."""
    monkeypatch.setattr(threads, "allowed_cpus", lambda: 2)
    monkeypatch.setattr(threads, "_warned", set())
    monkeypatch.delenv("TOYGRAPH_THREADS", raising=False)
    assert threads.resolve(count) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"--threads {count} is more than the 2 CPUs this process may use: computing with 2"]
    caplog.clear()
    monkeypatch.setenv("TOYGRAPH_THREADS", str(count))
    assert threads.resolve(None) == 2 and threads.resolve(None) == 2   # said once
    assert [r.getMessage() for r in caplog.records] == [
        f"TOYGRAPH_THREADS={count} is more than the 2 CPUs this process may use: "
        "computing with 2"]


def test_the_flag_past_the_cpus_sizes_the_pool_to_them(monkeypatch, caplog):
    if engine.library() is None:
        pytest.skip("no host C++ compiler")
    monkeypatch.setattr(threads, "_warned", set())
    allowed = threads.allowed_cpus()
    main(["eval", "--model", "nothing.gguf", "--text", "x", "--threads", str(2**32 + 1)])
    assert engine.library().tg_threads() == allowed
    assert f"more than the {allowed} CPU" in caplog.text


def test_the_engine_takes_a_64_bit_count_and_bounds_it():
    """The C++ side never wraps a count: 2^32 + 1 is many threads (bounded by the pool's own
    limit), not 1; engine.set_threads refuses a count past that limit."""
    if engine.library() is None:
        pytest.skip("no host C++ compiler")
    assert engine.library().tg_set_threads(2**32 + 1) == engine.MAX_THREADS
    engine.set_threads(1)
    with pytest.raises(ToygraphError, match="at most"):
        engine.set_threads(2**32 + 1)


THREAD_COUNTS = ["1", "2", "3", "0", "-1", "+2", " 2 ", "1e3", "2.0", "abc", "0x10", "\u00b2",
                 "\u0661\u0662", "1_000", str(2**31), str(2**32 + 1), str(2**63), str(10**40)]


@pytest.mark.parametrize("raw", THREAD_COUNTS)
def test_any_thread_count_is_capped_or_refused_in_one_line(raw, monkeypatch, caplog):
    """The variable's fuzz: every value is a count from 1 to the CPUs allowed, or a
    SettingError naming the variable; never a traceback of another kind, never more."""
    monkeypatch.setattr(threads, "allowed_cpus", lambda: 2)
    monkeypatch.setattr(threads, "_warned", set())
    monkeypatch.setenv("TOYGRAPH_THREADS", raw)
    try:
        n = threads.resolve(None)
    except SettingError as e:
        assert "TOYGRAPH_THREADS" in str(e) and "\n" not in str(e)
    else:
        assert 1 <= n <= 2
        assert len(caplog.records) == (int(raw) > 2)


@pytest.mark.parametrize("raw", ["0", "-5", "abc", str(2**63), str(10**40)])
def test_any_threads_flag_is_capped_or_refused(raw, capsys, monkeypatch):
    monkeypatch.setattr(threads, "_warned", set())
    try:
        rc = main(["eval", "--model", "nothing.gguf", "--text", "x", "--threads", raw])
    except SystemExit as e:   # argparse's own refusal of a non-number: usage and one error
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if engine.library() is not None:
        assert 1 <= engine.library().tg_threads() <= threads.allowed_cpus()
