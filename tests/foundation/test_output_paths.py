"""What a write may replace (issue 46 item 1): a regular file or nothing. A device, a FIFO,
a directory or a symbolic link at an output path is refused in one line and left as it was;
an append (the event log) never follows a link; the demo replaces only an earlier demo."""
import json
import os
import stat
import threading

import pytest

from test_cli import run
from toygraph.atomic import OutputPathError, atomic_write, check_replaceable, open_append
from toygraph.training.run_dir import EventLog, RunError


def _fifo(path):
    os.mkfifo(path)
    return path


def _link(path, target):
    os.symlink(target, path)
    return path


#: each kind of thing a write must not replace, made in a folder; (name, maker)
NOT_FILES = [
    ("fifo", lambda d: _fifo(d / "out")),
    ("directory", lambda d: (d / "out").mkdir() or d / "out"),
    ("link", lambda d: _link(d / "out", (d / "target").write_text("keep") and d / "target")),
    ("dangling link", lambda d: _link(d / "out", d / "nowhere")),
]


def _state(path):
    """What a path is, to compare before and after (its inode, mode and link target)."""
    st = os.lstat(path)
    return st.st_ino, st.st_mode, os.readlink(path) if stat.S_ISLNK(st.st_mode) else None


@pytest.mark.parametrize("kind,make", NOT_FILES, ids=[k for k, _ in NOT_FILES])
def test_atomic_write_refuses_what_is_not_a_regular_file(tmp_path, kind, make):
    path = make(tmp_path)
    before = _state(path)
    with pytest.raises(OutputPathError, match=f"--out {path} is "):
        atomic_write(path, lambda tmp: open(tmp, "w").write("x"), "--out")
    assert _state(path) == before
    assert sorted(p.name for p in tmp_path.iterdir() if ".partial" in p.name) == []
    if kind == "link":
        assert (tmp_path / "target").read_text() == "keep"


def test_atomic_write_creates_and_replaces_regular_files(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, lambda tmp: open(tmp, "w").write("one"))
    atomic_write(path, lambda tmp: open(tmp, "w").write("two"))
    assert path.read_text() == "two" and stat.S_ISREG(os.lstat(path).st_mode)


def test_dev_null_is_refused_and_stays_a_device():
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    with pytest.raises(OutputPathError, match="/dev/null is a character device"):
        check_replaceable("/dev/null", "--out")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_export_to_dev_null_is_one_line_before_any_work(capsys, tiny_llama, tmp_path):
    """The --out check comes first: the adapter named does not even exist."""
    code, _, err = run(capsys, "export", "--model", str(tiny_llama), "--adapter",
                       str(tmp_path / "no-such-run"), "--out", "/dev/null")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--out /dev/null is a character device" in err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_export_into_a_fifo_does_not_hang_or_replace_it(capsys, tiny_llama, tmp_path):
    fifo = _fifo(tmp_path / "merged.gguf")
    code, _, err = run(capsys, "export", "--model", str(tiny_llama), "--adapter",
                       str(tmp_path), "--out", str(fifo))
    assert code == 2 and "is a FIFO" in err and stat.S_ISFIFO(os.lstat(fifo).st_mode)


# --- appends --------------------------------------------------------------------------------
def test_a_linked_event_log_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    log = _link(tmp_path / "events.jsonl", target)
    with pytest.raises(OutputPathError, match="symbolic link"):
        EventLog(log)
    assert target.read_text() == "precious\n" and os.path.islink(log)


def test_a_fifo_event_log_is_refused_without_blocking(tmp_path):
    log = _fifo(tmp_path / "events.jsonl")
    done = []
    worker = threading.Thread(target=lambda: done.append(_refusal(lambda: EventLog(log))),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert done and "FIFO" in done[0]


def _refusal(make):
    try:
        make()
    except OutputPathError as e:
        return str(e)
    return "accepted"


def test_open_append_appends_to_a_regular_file(tmp_path):
    path = tmp_path / "log"
    path.write_text("a\n")
    fd = open_append(path)
    os.write(fd, b"b\n")
    os.close(fd)
    assert path.read_text() == "a\nb\n"


def test_the_event_log_still_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"event": "a"}\n{"event": "b", "ti')
    log = EventLog(path)
    log.write("c")
    log.close()
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["a", "c"]


def test_a_resume_through_a_linked_event_log_is_refused(tiny_llama, tmp_path, capsys):
    """--resume of a run whose events.jsonl was replaced by a link: refused, nothing
    appended to the link's target (the attack's file outside the run directory)."""
    from test_run import write_chat_data
    data = write_chat_data(tmp_path / "chat.jsonl")
    out = tmp_path / "r"
    args = ["finetune", "--model", str(tiny_llama), "--data", str(data), "--steps", "2",
            "--batch", "2", "--seq-len", "32", "--rank", "2", "--val-split", "0", "--quiet"]
    assert run(capsys, *args, "--out", str(out))[0] == 0
    target = tmp_path / "outside"
    target.write_text("mine\n")
    (out / "events.jsonl").unlink()
    _link(out / "events.jsonl", target)
    code, _, err = run(capsys, *args, "--steps", "3", "--allow-change", "steps", "--out", str(out),
                       "--resume", str(out))
    assert code == 2 and "events.jsonl is a symbolic link" in err, err
    assert target.read_text() == "mine\n"


def test_the_result_is_not_moved_over_a_fifo(tmp_path):
    from toygraph.training.result import publish
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir(), out.mkdir()
    (tmp / "Modelfile").write_text("FROM x\n")
    (tmp / "adapter_model.safetensors").write_text("w")
    _fifo(out / "Modelfile")
    with pytest.raises(OutputPathError, match="Modelfile is a FIFO"):
        publish(tmp, out)
    assert stat.S_ISFIFO(os.lstat(out / "Modelfile").st_mode)
    assert not (out / "adapter_model.safetensors").exists()


# --- the demo -------------------------------------------------------------------------------
def _run_dir(out, data):
    out.mkdir(parents=True)
    (out / "events.jsonl").write_text('{"event": "run_start"}\n')
    (out / "adapter_model.safetensors").write_text("trained for hours")
    (out / "run.yaml").write_text(f"data: [{json.dumps(str(data))}]\nmodel: m.gguf\n")
    return out


def test_the_demo_refuses_a_directory_holding_another_run(tmp_path, capsys):
    out = _run_dir(tmp_path / "run", tmp_path / "mine.jsonl")
    code, _, err = run(capsys, "demo", "--out", str(out))
    assert code == 2 and "holds a run that is not the demo's" in err, err
    assert (out / "adapter_model.safetensors").read_text() == "trained for hours"


def test_the_demo_refuses_a_directory_of_other_files(tmp_path):
    from toygraph.demo.capitals import check_demo_out
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(RunError, match="not the demo's"):
        check_demo_out(str(tmp_path))


def test_the_demo_replaces_an_earlier_demo(tmp_path):
    from toygraph.demo.capitals import check_demo_out, data_path, is_demo_run
    out = _run_dir(tmp_path / "demo", data_path())
    assert is_demo_run(out)
    check_demo_out(str(out))          # accepted: the demo overwrites its own run
    check_demo_out(str(tmp_path / "fresh"))


def test_the_demo_replaces_an_earlier_mixed_demo(tmp_path, monkeypatch):
    """A demo trained on its data mix (capitals.jsonl and general.jsonl, weighted or not)
    is the demo's; a mix with any other file is not."""
    from toygraph.demo import capitals
    monkeypatch.setattr(capitals, "DATA", {"capitals.jsonl": 0.8, "general.jsonl": 0.2})
    here = capitals.data_path().parent

    def written(data):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        _run_dir(out, "x")
        (out / "run.yaml").write_text(f"data: {json.dumps(data)}\nmodel: m.gguf\n")
        return out
    assert capitals.data_files() == [f"{here / 'capitals.jsonl'}:0.8",
                                     f"{here / 'general.jsonl'}:0.2"]
    assert capitals.is_demo_run(written(capitals.data_files()))
    assert capitals.is_demo_run(written([str(here / n) for n in capitals.DATA]))
    assert not capitals.is_demo_run(written([*capitals.data_files(), str(tmp_path / "mine.jsonl")]))
