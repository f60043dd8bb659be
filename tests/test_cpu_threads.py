"""toygraph/cpu/threads.py and ``--threads``: one count for the engine's pool and BLAS's,
from the flag, $TOYGRAPH_THREADS or the CPUs this process may use; every command that
computes has the flag."""
import os

import numpy as np
import pytest

from toygraph.cli.main import WITHOUT_COMPUTE, build_parser, main
from toygraph.cpu import engine, threads
from toygraph.errors import SettingError


@pytest.fixture(autouse=True)
def restore():
    yield
    engine.use_threads(None)


def test_the_count_comes_from_the_flag_the_variable_or_the_allowed_cpus(monkeypatch):
    monkeypatch.delenv("TOYGRAPH_THREADS", raising=False)
    assert threads.resolve(None) == len(os.sched_getaffinity(0))
    monkeypatch.setenv("TOYGRAPH_THREADS", "3")
    assert threads.resolve(None) == 3 and threads.resolve(5) == 5
    monkeypatch.setenv("TOYGRAPH_THREADS", "0")
    with pytest.raises(SettingError, match="TOYGRAPH_THREADS"):
        threads.resolve(None)
    with pytest.raises(SettingError, match="--threads must be at least 1"):
        threads.resolve(0)


def test_use_threads_sizes_the_engine_and_blas():
    threadpoolctl = pytest.importorskip("threadpoolctl")
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
