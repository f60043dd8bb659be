"""A run directory belongs to one run (issue 39): its run id is in every checkpoint, a
resume never writes into a directory of another run, pruning never deletes another run's
checkpoint, a resume from an earlier step sets the later ones aside and says so; the lock
cannot be won twice; a FIFO or device where a file is expected is refused, not read."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

import toygraph.training.run_dir as run_dir
from test_run import cfg_for, events, write_chat_data
from toygraph.errors import ToygraphError
from toygraph.training.checkpoints import (checkpoint_run_id, list_checkpoints,
                                           load_checkpoint, prune_checkpoints)
from toygraph.training.run import run_training
from toygraph.training.run_dir import RUN_ID_FILE, SUPERSEDED, RunError, RunLock


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def two_runs(tiny_llama, tmp_path_factory):
    """A: 2 steps, saved every step. B: another run, finished (4 steps, best/, result)."""
    root = tmp_path_factory.mktemp("lineage")
    data = write_chat_data(root / "chat.jsonl")
    a, b = root / "a", root / "b"
    run_training(cfg_for(tiny_llama, data, a, steps=2, save_every=1, eval_every=2))
    run_training(cfg_for(tiny_llama, data, b, steps=4, eval_every=2))
    return tiny_llama, data, a, b


def test_every_checkpoint_records_its_runs_id(two_runs):
    _, _, a, b = two_runs
    ids = {d: (d / RUN_ID_FILE).read_text().strip() for d in (a, b)}
    assert ids[a] != ids[b] and all(len(i) == 32 for i in ids.values())
    for d in (a, b):
        assert {checkpoint_run_id(p) for _, p in list_checkpoints(d)} == {ids[d]}
    assert checkpoint_run_id(b / "best") == ids[b]


def test_a_resume_into_another_runs_directory_is_refused_and_changes_nothing(two_runs, capsys):
    """The attack's worst case: A's checkpoint resumed with --out B (finished) replaced B's
    result and best/ and pruned the new run's checkpoints at once."""
    from toygraph.cli import main
    model, data, a, b = two_runs
    before = _tree(b)
    with pytest.raises(RunError, match=r"holds another run \(run id [0-9a-f]{8}\), the "
                                       r"checkpoint is of run [0-9a-f]{8}"):
        run_training(cfg_for(model, data, b, steps=4, eval_every=2, allow_change=("steps",),
                             resume=str(a / "checkpoints" / "step-000002")))
    code = main(["finetune", "--model", str(model), "--data", str(data), "--out", str(b),
                 "--resume", str(a / "checkpoints" / "step-000002"), "--steps", "4",
                 "--allow-change", "steps", "--rank", "4", "--alpha", "8", "--targets", "q,v",
                 "--batch", "2", "--seq-len", "32", "--lr", "5e-3", "--seed", "7",
                 "--val-split", "0.25", "--eval-every", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "holds another run" in err and len(err.strip().splitlines()) == 1
    assert _tree(b) == before


def test_a_resume_into_a_new_directory_is_a_new_run(two_runs, tmp_path):
    model, data, a, _ = two_runs
    out = tmp_path / "branch"
    s = run_training(cfg_for(model, data, out, steps=3, save_every=1, eval_every=2,
                             resume=str(a / "checkpoints" / "step-000002"),
                             allow_change=("steps",)))
    assert s["status"] == "completed" and s["steps"] == 3
    mine = (out / RUN_ID_FILE).read_text().strip()
    assert mine != (a / RUN_ID_FILE).read_text().strip()
    assert [checkpoint_run_id(p) for _, p in list_checkpoints(out)] == [mine]


def test_pruning_never_deletes_another_runs_checkpoint(two_runs, tmp_path):
    _, _, a, b = two_runs
    out = tmp_path / "mixed"
    shutil.copytree(a, out)
    shutil.copytree(b / "checkpoints" / "step-000004", out / "checkpoints" / "step-000009")
    gone = prune_checkpoints(out, 1, (a / RUN_ID_FILE).read_text().strip())
    assert [p.name for p in gone] == ["step-000001"]
    assert [s for s, _ in list_checkpoints(out)] == [2, 9]


def test_a_resume_from_an_earlier_step_sets_the_later_checkpoints_aside(two_runs, tmp_path,
                                                                      capsys):
    """Resumed from step 1 of 4 (a changed lr): the old steps 2-4 would sort newer than the
    new course's, so keep_checkpoints=2 pruned the new ones at once and a later --resume
    continued the old course. They are moved to superseded/ and the run says so."""
    model, data, _, _ = two_runs
    out = tmp_path / "r"
    run_training(cfg_for(model, data, out, steps=4, save_every=1, val_split=0,
                         keep_checkpoints=10))
    s = run_training(cfg_for(model, data, out, steps=4, save_every=1, val_split=0,
                             keep_checkpoints=2, lr=1e-3, allow_change=("lr",),
                             resume=str(out / "checkpoints" / "step-000001"), quiet=False))
    assert s["status"] == "completed"
    err = capsys.readouterr().err
    assert "moved the run's later checkpoints (step-000002, step-000003, step-000004)" in err
    assert [st for st, _ in list_checkpoints(out)] == [3, 4]
    for _, p in list_checkpoints(out):   # the new course's: trained at the new lr
        assert load_checkpoint(p)[0]["options"]["lr"] == 1e-3
    assert sorted(p.name for p in (out / SUPERSEDED).iterdir()) == \
        ["step-000002", "step-000003", "step-000004"]


# --- the lock --------------------------------------------------------------------------------------
def test_two_runs_racing_for_a_stale_lock_never_both_win(tmp_path, monkeypatch):
    """A stale lock (its process gone), two runs taking it over at once. Run A is held
    just after it found the owner dead, until run B is done: with a lock taken by reading,
    unlinking and re-creating the file, A then unlinked B's fresh lock and both ran."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    path = tmp_path / ".lock"
    path.write_text(json.dumps({"pid": int(dead), "host": socket.gethostname(), "start": "0"}))
    a_checking, b_done = threading.Event(), threading.Event()
    real_alive = run_dir._alive

    def alive(pid):
        if threading.current_thread().name == "A":
            a_checking.set()
            b_done.wait(10)
        return real_alive(pid)
    monkeypatch.setattr(run_dir, "_alive", alive)
    results = {}

    def take(name):
        lock = RunLock(path)
        try:
            lock.acquire()
            results[name] = lock
        except RunError as e:
            results[name] = e
        finally:
            if name == "B":
                b_done.set()
    a = threading.Thread(target=take, args=("A",), name="A")
    a.start()
    assert a_checking.wait(10)
    b = threading.Thread(target=take, args=("B",), name="B")
    b.start()
    b.join(10)
    a.join(10)
    winners = [n for n, r in results.items() if isinstance(r, RunLock)]
    assert len(winners) == 1, results
    assert "in use by another run" in str(results[{"A": "B", "B": "A"}[winners[0]]])
    results[winners[0]].release()


def test_a_lock_of_a_live_process_without_flock_still_counts(tmp_path):
    """A lock file an older toygraph wrote (O_EXCL, no flock) while its process lives."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / ".lock"
        path.write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(),
                                    "start": run_dir._process_start(other.pid)}))
        with pytest.raises(RunError, match=rf"in use by another run \(pid {other.pid}\)"):
            RunLock(path).acquire()
    finally:
        other.kill()
        other.wait()
    lock = RunLock(path)
    lock.acquire()   # its process is gone: taken over
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    path = tmp_path / ".lock"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "elsewhere")
    t0 = time.monotonic()
    with pytest.raises(RunError, match="lock file .* (is a FIFO|is a symbolic link)"):
        RunLock(path).acquire()
    assert time.monotonic() - t0 < 5 and not (tmp_path / "elsewhere").exists()


# --- FIFOs and devices where a file is expected ------------------------------------------------------
def _one_line_error_within(seconds: float, argv: list[str]) -> str:
    """Run the CLI with ``argv`` in a subprocess; it must end within ``seconds`` with one
    error line (not a hang, not a traceback)."""
    proc = subprocess.run([sys.executable, "-m", "toygraph.cli", *argv], capture_output=True,
                          text=True, timeout=seconds, stdin=subprocess.DEVNULL)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["--config", "--data", "json-schema", "eval --data"])
def test_a_fifo_or_device_where_a_file_is_expected_is_refused(tiny_llama, tmp_path, where):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    data = write_chat_data(tmp_path / "chat.jsonl")
    base = ["finetune", "--model", str(tiny_llama), "--out", str(tmp_path / "r"), "--steps", "1",
            "--quiet"]
    for bad in (fifo, "/dev/zero"):
        if where == "--config":
            argv = [*base, "--data", str(data), "--config", str(bad)]
        elif where == "--data":
            argv = [*base, "--data", str(bad)]
        elif where == "eval --data":
            argv = ["eval", "--model", str(tiny_llama), "--data", str(bad)]
        else:
            prompts = tmp_path / "prompts.jsonl"
            prompts.write_text('{"prompt": "say 1"}\n{"prompt": "say 2"}\n')
            argv = [*base, "--data", str(prompts), "--recipe", "grpo", "--reward",
                    f"json-schema:{bad}", "--val-split", "0", "--seq-len", "16",
                    "--num-generations", "2", "--max-completion-length", "4"]
        line = _one_line_error_within(60, argv)
        assert str(bad) in line and ("FIFO" in line or "character device" in line), line
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").iterdir())


def test_the_regular_file_helpers():
    from toygraph.bounded import read_bytes
    from toygraph.files import check_regular_file
    with pytest.raises(ToygraphError, match=r"--x /dev/null: not a regular file \(a character device\)"):
        check_regular_file("/dev/null", "--x")
    with pytest.raises(ToygraphError, match="not a regular file \\(a directory\\)"):
        read_bytes("/", "--x")
    assert read_bytes(__file__, "--x")[:3] == b'"""'
