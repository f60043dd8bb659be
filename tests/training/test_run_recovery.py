"""The recovery path recovers (issue 39): whatever stops a run after its last step -- a
signal, a full disk, a MemoryError, the model file gone -- leaves no partial result at the
top of the run directory, and the ``--resume`` the run prints writes the result, the same
bytes as a run that was never stopped. The fault is injected at each file the final write
creates (the final checkpoint, each file of the top level, the move into place), and after
the last step before its evaluation."""
import errno
import os
import shutil
import signal
from pathlib import Path

import pytest

import toygraph.adapters.files as adapter_files
import toygraph.adapters.modelfile as modelfile
import toygraph.training.checkpoints as ckpt
from test_run import cfg_for, write_chat_data
from toygraph.training.checkpoints import find_resumable, load_checkpoint
from toygraph.training.run import run_training
from toygraph.training.run_dir import FINAL_ARTIFACTS, RESULT_ASIDE, read_events

TOP = ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf", "Modelfile")


def _cfg(setup, out, **kw):
    model, data, _ = setup
    return cfg_for(model, data, out, **{"steps": 2, "eval_every": 1, "val_split": 0.25, **kw})


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """A copy of the tiny model (a case may move it away), the data, and the top level of
    the run never stopped."""
    root = tmp_path_factory.mktemp("recovery")
    model = root / "model.gguf"
    shutil.copyfile(tiny_llama, model)
    data = write_chat_data(root / "chat.jsonl")
    ref = root / "ref"
    assert run_training(_cfg((model, data, None), ref))["status"] == "completed"
    return model, data, {name: (ref / name).read_bytes() for name in TOP}


def _fault(kind: str, model: Path):
    """Do fault ``kind`` here and now."""
    if kind == "SIGINT":
        os.kill(os.getpid(), signal.SIGINT)   # the run's handler raises at once
    elif kind == "ENOSPC":
        raise OSError(errno.ENOSPC, "No space left on device")
    elif kind == "MemoryError":
        raise MemoryError()
    elif kind == "model gone" and model.exists():
        model.rename(model.with_name("moved-away.gguf"))


def _inject(monkeypatch, target: str, kind: str, model: Path, out: Path):
    """Patch the writer of ``target`` (a file of the final write) to meet fault ``kind``
    once, just before it writes."""
    fired = []

    def once():
        if not fired:
            fired.append(1)
            _fault(kind, model)

    if target == "final checkpoint":   # its manifest, written last, says "finishing"
        real_manifest = ckpt._write_manifest

        def write_manifest(folder):
            if load_checkpoint_state(folder).get("status") == "finishing":
                once()
            real_manifest(folder)
        monkeypatch.setattr(ckpt, "_write_manifest", write_manifest)
    elif target == "into place":   # publishing: the result file, moved last
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if Path(dst) == out / "adapter_model.safetensors":
                once()
            return real_replace(src, dst, *a, **k)
        monkeypatch.setattr(os, "replace", replace)
    else:
        module = modelfile if target == "Modelfile" else adapter_files
        real_write = module.atomic_write

        def atomic_write(path, write):
            if Path(path).name == target and Path(path).parent.name.startswith(".final."):
                once()
            return real_write(path, write)
        monkeypatch.setattr(module, "atomic_write", atomic_write)
    return fired


def load_checkpoint_state(folder):
    import json
    return json.loads((Path(folder) / "state.json").read_text())


CASES = [("SIGINT", "adapter_model.safetensors"), ("ENOSPC", "adapter_config.json"),
         ("MemoryError", "adapter.gguf"), ("model gone", "Modelfile"),
         ("ENOSPC", "final checkpoint"), ("SIGINT", "into place"),
         ("model gone", "adapter_model.safetensors")]
SLOW = [(f, t) for f in ("SIGINT", "ENOSPC", "MemoryError", "model gone")
        for t in ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf",
                  "Modelfile", "final checkpoint", "into place") if (f, t) not in CASES]


@pytest.mark.parametrize("fault, target", CASES + [pytest.param(*c, marks=pytest.mark.slow)
                                                   for c in SLOW])
def test_a_fault_in_the_final_write_is_recovered_by_the_printed_resume(
        setup, tmp_path, monkeypatch, capsys, fault, target):
    model, data, ref = setup
    out = tmp_path / "run"
    fired = _inject(monkeypatch, target, fault, model, out)
    try:
        try:
            summary = run_training(_cfg(setup, out))
        except (OSError, MemoryError, Exception):
            summary = None
        assert fired
        status = read_events(out / "events.jsonl")[-1]["status"]
        if summary is not None and summary["status"] == "completed":
            # the fault came after the write needed it (a model gone after its last read)
            assert fault == "model gone"
        else:
            assert status != "completed"
            # all of the top level or none of it: none
            assert not [n for n in FINAL_ARTIFACTS if (out / n).exists()], list(out.iterdir())
            assert not list(out.glob(".final.*"))
            printed = capsys.readouterr().err
            assert f"--resume {out}" in printed
            newest, _ = find_resumable(out)
            state = load_checkpoint(newest)[0]
            assert state["step"] == 2 and state["status"] != "completed"
            monkeypatch.undo()
            moved = model.with_name("moved-away.gguf")
            if moved.exists():
                moved.rename(model)   # the user puts the model back
            summary = run_training(_cfg(setup, out, resume=str(out)))
            assert summary["status"] == "completed" and "top level written" in summary["reason"]
    finally:
        moved = model.with_name("moved-away.gguf")
        if moved.exists():
            moved.rename(model)
    for name in TOP:
        assert (out / name).read_bytes() == ref[name], name
    assert read_events(out / "events.jsonl")[-1]["status"] == "completed"
    again = run_training(_cfg(setup, out, resume=str(out)))   # and then: nothing to do
    assert again["reason"].startswith("nothing to do")


def test_a_signal_after_the_last_step_before_its_evaluation(setup, tmp_path, monkeypatch):
    """Stopped after step 2 before step 2's evaluation: the resume evaluates it, as the run
    would have, and so picks the same best/ for the result."""
    import toygraph.training.run_dir as runs
    real = runs.EventLog.write

    def write(self, event, **fields):
        real(self, event, **fields)
        if event == "step" and fields["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(runs.EventLog, "write", write)
    out = tmp_path / "run"
    s = run_training(_cfg(setup, out))
    assert s["status"] == "interrupted" and not (out / "adapter_model.safetensors").exists()
    assert [e["step"] for e in read_events(out / "events.jsonl") if e["event"] == "eval"] == [0, 1]
    monkeypatch.undo()
    s = run_training(_cfg(setup, out, resume=str(out)))
    assert s["status"] == "completed"
    assert [e["step"] for e in read_events(out / "events.jsonl") if e["event"] == "eval"] == [0, 1, 2]
    for name in TOP:
        assert (out / name).read_bytes() == setup[2][name], name


def test_extending_a_finished_run_keeps_its_result_when_the_extension_fails(setup, tmp_path,
                                                                         monkeypatch):
    """--resume with more steps sets the finished result aside; a full disk at the
    extension's first checkpoint puts it back (all four files, the same bytes); a
    successful extension replaces it."""
    from safetensors import numpy as stnp
    out = tmp_path / "run"
    run_training(_cfg(setup, out))
    before = {name: (out / name).read_bytes() for name in TOP}
    real = stnp.save_file

    def save_file(tensors, path, *a, **k):
        if "step-000003" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(stnp, "save_file", save_file)
    with pytest.raises(Exception, match="No space left on device"):
        run_training(_cfg(setup, out, resume=str(out), steps=4, allow_change=("steps",)))
    assert {name: (out / name).read_bytes() for name in TOP} == before
    assert not (out / RESULT_ASIDE).exists()
    monkeypatch.undo()
    s = run_training(_cfg(setup, out, resume=str(out), steps=4, allow_change=("steps",)))
    assert s["status"] == "completed" and s["steps"] == 4
    assert (out / "adapter_model.safetensors").read_bytes() != before["adapter_model.safetensors"]
    assert not (out / RESULT_ASIDE).exists()


def test_what_a_kill_during_an_extension_leaves_is_put_right(setup, tmp_path):
    """A kill -9 while an extension trains leaves the finished result set aside and the
    top level empty. The next start with nothing left to train writes the result from the
    final checkpoint (the same bytes) and drops the one set aside; one that trains keeps it
    aside until its own result replaces it."""
    from toygraph.training.result import set_aside_result
    out = tmp_path / "run"
    run_training(_cfg(setup, out))
    before = {name: (out / name).read_bytes() for name in TOP}
    assert set_aside_result(out) and not (out / "adapter_model.safetensors").exists()
    s = run_training(_cfg(setup, out, resume=str(out)))
    assert s["status"] == "completed" and "top level written" in s["reason"]
    assert {name: (out / name).read_bytes() for name in TOP} == before
    assert not (out / RESULT_ASIDE).exists()
    assert set_aside_result(out)
    s = run_training(_cfg(setup, out, resume=str(out), steps=3, allow_change=("steps",)))
    assert s["status"] == "completed" and s["steps"] == 3 and not (out / RESULT_ASIDE).exists()
