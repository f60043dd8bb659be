"""Run safety: a run is never lost, mixed with another or misreported (issues 11 and 18).

In-process runs on the tiny model; each test checks the files a run leaves behind."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import toygraph.training.checkpoints as ckpt
from test_run import cfg_for, events, write_chat_data
from toygraph.training.checkpoints import find_resumable, list_checkpoints, load_checkpoint, verify_checkpoint
from toygraph.errors import DataError, ToygraphError
from toygraph.training.resume import ResumeMismatch
from toygraph.training.run_dir import RunError, read_events
from toygraph.training.run import run_training

@pytest.fixture
def chat_data(tmp_path):
    return write_chat_data(tmp_path / "chat.jsonl")


FINAL = ("adapter_model.safetensors", "adapter_config.json", "adapter.gguf")


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def strict_lines(path):
    """Every line of an events file parsed as strict JSON (NaN/Infinity refused)."""
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def step_losses(out):
    """{step: loss} from a run's events; a resumed run's repeat of a step overwrites it."""
    return {e["step"]: e["loss"] for e in events(out) if e["event"] == "step"}


@pytest.fixture(scope="module")
def base_run(tiny_llama, tmp_path_factory):
    """A completed 6-step run with checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("base")
    data = write_chat_data(root / "chat.jsonl")
    out = root / "run"
    summary = run_training(cfg_for(tiny_llama, data, out))
    assert summary["status"] == "completed"
    return tiny_llama, data, out


# --- the run directory ---------------------------------------------------------------------------
def test_a_second_run_into_a_run_directory_is_refused_and_changes_nothing(base_run, capsys):
    from toygraph.cli import main
    model, data, out = base_run
    before = snapshot(out)
    with pytest.raises(RunError, match="holds a run; pass --resume"):
        run_training(cfg_for(model, data, out, seed=8))
    code = main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out),
                 "--steps", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "holds a run" in err and "Traceback" not in err
    assert snapshot(out) == before


def test_overwrite_replaces_the_run(tiny_llama, chat_data, tmp_path):
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, steps=3, val_split=0.0))
    (out / "notes.txt").write_text("mine")
    run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0.0, overwrite=True))
    assert [e["event"] for e in events(out)].count("run_start") == 1
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own files are replaced


HOLD_LOCK = """
import sys, time
from pathlib import Path
from toygraph.training.run_dir import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_lock_refuses_and_a_dead_one_is_taken_over(tiny_llama, chat_data, tmp_path):
    from toygraph.training.run_dir import LOCK_FILE
    out = tmp_path / "r"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out / LOCK_FILE)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=rf"in use by another run \(pid {other.pid}\)"):
            run_training(cfg_for(tiny_llama, chat_data, out, steps=1, resume=None, overwrite=True))
    finally:
        other.kill()
        other.wait()
    assert (out / LOCK_FILE).exists()   # killed: its lock file stays, and is stale
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=1, val_split=0.0, overwrite=True))
    assert s["status"] == "completed" and not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("out_of", ["empty", "under_file"])
def test_unusable_out_is_a_one_line_error(tiny_llama, chat_data, tmp_path, out_of):
    f = tmp_path / "file"
    f.write_text("x")
    out = "" if out_of == "empty" else str(f / "run")
    with pytest.raises(RunError if out_of == "under_file" else ToygraphError, match="--out") as e:
        run_training(cfg_for(tiny_llama, chat_data, out, steps=1))
    assert "\n" not in str(e.value)


# --- failures are recorded as failures -----------------------------------------------------------
def _finetune(model, data, out, steps):
    return [sys.executable, "-m", "toygraph.cli", "finetune", "--model", str(model),
            "--data", str(data), "--out", str(out), "--steps", str(steps), "--batch", "2",
            "--seq-len", "32", "--rank", "2", "--val-split", "0"]


def _saved_and_resumable(out, steps_before):
    """The run ended as Ctrl-C ends one: interrupted, its checkpoint verifies, and the log
    says how to resume (stderr being gone, the log is where it can be read)."""
    end = events(out)[-1]
    assert end["event"] == "run_end" and end["status"] == "interrupted", end
    assert "closed output" in end["reason"] and "pipe" in end["reason"].lower(), end
    assert 0 < end["steps"] <= steps_before
    assert verify_checkpoint(out / "checkpoints" / f"step-{end['steps']:06d}") is None
    assert end["resume"] == f"toygraph finetune --config {out / 'run.yaml'} --resume {out}"
    assert not any((out / n).exists() for n in FINAL)


def test_a_log_pipe_closed_before_the_run_saves_and_says_how_to_resume(tiny_llama, chat_data,
                                                                      tmp_path):
    """stderr is a pipe whose reader went away (``finetune ... 2>&1 | head``) before the
    first progress line: the run stops after its first step and saves it."""
    out = tmp_path / "r"
    proc = subprocess.Popen(_finetune(tiny_llama, chat_data, out, 40), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    proc.stderr.close()  # the reader is gone before the first progress line
    assert proc.wait(timeout=120) == 130
    _saved_and_resumable(out, 40)


def test_a_log_pipe_closed_mid_run_saves_what_was_trained(tiny_llama, chat_data, tmp_path):
    """``| head -3``: the reader takes a few lines, then goes; the steps trained so far are
    saved, not lost (issue 46: 1,200 steps were)."""
    out = tmp_path / "r"
    proc = subprocess.Popen(_finetune(tiny_llama, chat_data, out, 100000),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines = [proc.stderr.readline() for _ in range(3)]
    proc.stderr.close()
    assert proc.wait(timeout=120) == 130, lines
    _saved_and_resumable(out, 100000)


def test_a_closed_stdout_still_completes_cleanly(tiny_llama, chat_data, tmp_path):
    """``finetune ... | head -0``: only the summary goes to stdout, at the end; the run
    completes and the exit is its status, without an exit-time BrokenPipeError."""
    out = tmp_path / "r"
    proc = subprocess.Popen(_finetune(tiny_llama, chat_data, out, 2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert events(out)[-1]["status"] == "completed"


def test_progress_that_cannot_write_asks_once_to_stop():
    from toygraph.training.supervisor import Progress

    class Closed:
        writes = 0

        def write(self, text):
            Closed.writes += 1
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            pass

        def isatty(self):
            return False
    told = []
    progress = Progress(10, quiet=False, stream=Closed(), tty=False)
    progress.on_lost = told.append
    progress.update(1, 2.0, 100.0)
    progress.message("more")
    progress.update(2, 2.0, 100.0, extra="a note")
    assert told == ["a closed output (Broken pipe)"] and Closed.writes == 1


def test_an_exception_mid_loop_is_failed_with_no_final_artifacts(tiny_llama, chat_data, tmp_path,
                                                                monkeypatch):
    import toygraph.training.supervisor as sup
    real = sup.Progress.update

    def update(self, t, *a, **k):
        if t == 4:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return real(self, t, *a, **k)
    monkeypatch.setattr(sup.Progress, "update", update)
    out = tmp_path / "r"
    with pytest.raises(BrokenPipeError):
        run_training(cfg_for(tiny_llama, chat_data, out, steps=6, eval_every=3))
    end = events(out)[-1]
    assert (end["event"], end["status"], end["steps"]) == ("run_end", "failed", 4)
    assert not any((out / n).exists() for n in FINAL)
    assert [s for s, _ in list_checkpoints(out)] == [3]  # no "final" checkpoint either


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tiny_llama, chat_data, tmp_path,
                                                             monkeypatch):
    from safetensors import numpy as stnp
    real = stnp.save_file
    calls = []

    def save_file(tensors, path, *a, **k):
        calls.append(path)
        if "step-000004" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(stnp, "save_file", save_file)
    out = tmp_path / "r"
    with pytest.raises(RunError) as e:
        run_training(cfg_for(tiny_llama, chat_data, out, steps=6, save_every=2, val_split=0.0))
    msg = str(e.value)
    assert "\n" not in msg and "step-000004" in msg and "No space left on device" in msg
    assert "earlier checkpoints are intact" in msg and "step-000002" in msg
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert verify_checkpoint(out / "checkpoints" / "step-000002") is None
    state, weights, _ = load_checkpoint(out / "checkpoints" / "step-000002")
    assert state["step"] == 2 and weights
    assert events(out)[-1]["status"] == "failed"
    monkeypatch.setattr(stnp, "save_file", real)
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, save_every=2, val_split=0.0,
                             resume=str(out)))
    assert s["status"] == "completed"


# --- checkpoints: verification, ordering, retention ----------------------------------------------
def test_a_truncated_newest_checkpoint_is_skipped_and_resume_is_exact(base_run, tmp_path):
    model, data, first = base_run
    out = tmp_path / "run"
    shutil.copytree(first, out)
    newest = out / "checkpoints" / "step-000006" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    path, skipped = find_resumable(out)
    assert path.name == "step-000003"
    assert skipped[0][0].name == "step-000006" and "bytes" in skipped[0][1]
    run_training(cfg_for(model, data, out, resume=str(out)))
    start = [e for e in events(out) if e["event"] == "run_start"][-1]
    assert start["resumed_from"] == 3 and "step-000006" in start["skipped_checkpoints"][0]["path"]
    assert step_losses(out) == step_losses(first)
    assert (out / "adapter_model.safetensors").read_bytes() == \
        (first / "adapter_model.safetensors").read_bytes()


def test_checkpoints_order_by_number_past_step_999999(base_run, tmp_path):
    _, _, first = base_run
    for step in (999_999, 1_000_000, 20):
        shutil.copytree(first / "checkpoints" / "step-000003",
                        tmp_path / "checkpoints" / ckpt.step_dir_name(step))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 999_999, 1_000_000]
    assert find_resumable(tmp_path)[0].name == "step-1000000"


def test_keep_checkpoints_keeps_the_newest_and_best(tiny_llama, chat_data, tmp_path):
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, steps=6, save_every=1, keep_checkpoints=2))
    assert [s for s, _ in list_checkpoints(out)] == [5, 6]
    assert verify_checkpoint(out / "best") is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000005", "step-000006"]


def test_a_checkpoint_without_manifest_is_not_resumed(base_run, tmp_path):
    _, _, first = base_run
    ck = tmp_path / "ck"
    shutil.copytree(first / "checkpoints" / "step-000003", ck)
    (ck / "manifest.json").unlink()
    with pytest.raises(DataError, match="not a checkpoint .no manifest.json"):
        find_resumable(ck)


# --- resume refuses changed meaning ------------------------------------------------------------
@pytest.mark.parametrize("option, value", [
    ("alpha", 4.0), ("lr", 1e-2), ("schedule", "linear"), ("batch", 3), ("seed", 8),
    ("rank", 2), ("targets", ("q", "k")), ("seq_len", 24), ("clip", 0.5), ("recipe", "full"),
    ("steps", 8), ("val_split", 0.5),
])
def test_resume_with_a_changed_option_is_refused(base_run, option, value):
    model, data, out = base_run
    before = snapshot(out)
    with pytest.raises(ResumeMismatch) as e:
        run_training(cfg_for(model, data, out, resume=str(out), **{option: value}))
    msg = str(e.value)
    flag = "--" + option.replace("_", "-")
    assert "\n" not in msg and f"{flag} was " in msg and "now" in msg
    assert snapshot(out) == before


def test_resume_with_another_model_or_data_is_refused(base_run, tmp_path):
    from toygraph.fixtures.tiny_models import write_tiny_llama
    model, data, out = base_run
    other = write_tiny_llama(tmp_path / "same-shape.gguf", seed=1)
    with pytest.raises(ResumeMismatch, match=r"--model was tiny-llama.gguf .* now same-shape.gguf"):
        run_training(cfg_for(other, data, out, resume=str(out)))
    changed = tmp_path / "d.jsonl"
    changed.write_text(data.read_text().replace("say 3", "say three"))
    with pytest.raises(ResumeMismatch, match="--data was data with sha256"):
        run_training(cfg_for(model, changed, out, resume=str(out)))


def test_allow_change_lets_a_named_option_differ(base_run, tmp_path):
    model, data, first = base_run
    out = tmp_path / "run"
    shutil.copytree(first, out)
    s = run_training(cfg_for(model, data, out, resume=str(out / "checkpoints" / "step-000003"),
                             lr=1e-3, allow_change=("lr",)))
    assert s["status"] == "completed"
    start = [e for e in events(out) if e["event"] == "run_start"][-1]
    assert start["allowed_changes"] == ["lr"] and start["config"]["lr"] == 1e-3
    with pytest.raises(ResumeMismatch, match="--rank was 4 .* shapes the trainable tensors"):
        run_training(cfg_for(model, data, out, resume=str(out), rank=2, allow_change=("rank",)))


# --- the divergence guard ----------------------------------------------------------------------
def test_a_runaway_learning_rate_stops_as_diverged_and_keeps_the_good_checkpoint(base_run, tmp_path):
    model, data, first = base_run
    out = tmp_path / "run"
    shutil.copytree(first, out)
    shutil.rmtree(out / "checkpoints" / "step-000006")
    best_before = snapshot(out / "best")
    s = run_training(cfg_for(model, data, out, resume=str(out), lr=1e10, allow_change=("lr",)))
    assert s["status"] == "diverged" and "norm jumped" in s["reason"]
    end = strict_lines(out / "events.jsonl")[-1]
    assert end["event"] == "run_end" and end["status"] == "diverged"
    assert [st for st, _ in list_checkpoints(out)] == [3]  # nothing saved from the runaway state
    assert snapshot(out / "best") == best_before
    # the finished run's result, set aside while the resume trained, is back
    assert (out / "adapter_model.safetensors").read_bytes() == \
        (first / "adapter_model.safetensors").read_bytes()


def test_a_nan_loss_is_strict_json_and_diverged(tiny_llama, chat_data, tmp_path, monkeypatch):
    from toygraph.recipes.base import Recipe
    real = Recipe.step

    def step(self, *a, **k):
        loss = real(self, *a, **k)
        return float("nan") if self.step_index == 3 else loss
    monkeypatch.setattr(Recipe, "step", step)
    out = tmp_path / "r"
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, save_every=1))
    assert s["status"] == "diverged" and "loss nan" in s["reason"]
    lines = strict_lines(out / "events.jsonl")
    bad = [e for e in lines if e["event"] == "step" and e["step"] == 3][0]
    assert bad["loss"] is None and bad["nonfinite"] == {"loss": "nan"}
    assert [st for st, _ in list_checkpoints(out)] == [1, 2]


def test_the_loss_median_guard(tiny_llama, chat_data, tmp_path, monkeypatch):
    from toygraph.recipes.base import Recipe
    real = Recipe.step

    def step(self, *a, **k):
        loss = real(self, *a, **k)
        return loss * 50 if self.step_index == 7 else loss
    monkeypatch.setattr(Recipe, "step", step)
    s = run_training(cfg_for(tiny_llama, chat_data, tmp_path / "r", steps=8, val_split=0.0))
    assert s["status"] == "diverged" and "running median" in s["reason"] and s["steps"] == 7
    s = run_training(cfg_for(tiny_llama, chat_data, tmp_path / "off", steps=8, val_split=0.0,
                             diverge_factor=0.0))
    assert s["status"] == "completed"


def test_the_loss_median_guard_tolerates_a_hard_batch_near_zero():
    """A run that memorized its data (median loss 0.033) meets a batch it has not learned
    (0.357, 11x the median): not a divergence. Seen in the demo's second pass. A rise of
    nats from there, or 10x a median far from zero, still is."""
    from types import SimpleNamespace
    from toygraph.training.guard import DivergenceGuard, Diverged
    guard = DivergenceGuard(SimpleNamespace(recent_losses=[0.033] * 20))
    guard.check_step(21, 0.357, 1.6)
    with pytest.raises(Diverged, match="above 10 x the running median"):
        guard.check_step(22, 1.2, 1.0)
    high = DivergenceGuard(SimpleNamespace(recent_losses=[2.0] * 20))
    high.check_step(21, 19.0, 1.0)
    with pytest.raises(Diverged):
        high.check_step(22, 21.0, 1.0)


# --- signals and torn logs ---------------------------------------------------------------------
def _signal_after(monkeypatch, step, signals):
    import toygraph.training.run_dir as runs
    real = runs.EventLog.write

    def write(self, event, **fields):
        real(self, event, **fields)
        if event == "step" and fields["step"] == step:
            for sig in signals:
                os.kill(os.getpid(), sig)
    monkeypatch.setattr(runs.EventLog, "write", write)


def test_sigterm_is_handled_like_ctrl_c(tiny_llama, chat_data, tmp_path, monkeypatch):
    _signal_after(monkeypatch, 2, [signal.SIGTERM])
    out = tmp_path / "r"
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, val_split=0.0))
    assert s["status"] == "interrupted" and "SIGTERM" in s["reason"] and s["steps"] == 2
    assert verify_checkpoint(out / "checkpoints" / "step-000002") is None
    state = load_checkpoint(out / "checkpoints" / "step-000002")[0]
    assert (state["status"], state["step"], state["options"]["lr"]) == ("interrupted", 2, 5e-3)
    assert state["model_fingerprint"]["size"] == tiny_llama.stat().st_size
    assert not (out / "adapter_model.safetensors").exists()


def test_sighup_is_handled_like_ctrl_c(tiny_llama, chat_data, tmp_path, monkeypatch):
    """A closed terminal or a dropped ssh session (SIGHUP) saves the steps trained."""
    _signal_after(monkeypatch, 2, [signal.SIGHUP])
    out = tmp_path / "r"
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, val_split=0.0))
    assert s["status"] == "interrupted" and "SIGHUP" in s["reason"] and s["steps"] == 2
    assert verify_checkpoint(out / "checkpoints" / "step-000002") is None
    assert s["resume"] == f"toygraph finetune --config {out / 'run.yaml'} --resume {out}"
    assert events(out)[-1]["resume"] == s["resume"]


def test_a_second_ctrl_c_during_a_save_neither_corrupts_nor_skips_it(tiny_llama, chat_data,
                                                                    tmp_path, monkeypatch):
    real = ckpt._write_manifest
    sent = []

    def write_manifest(folder):
        if not sent:  # two Ctrl-C in the middle of the first checkpoint write
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        real(folder)
    monkeypatch.setattr(ckpt, "_write_manifest", write_manifest)
    out = tmp_path / "r"
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, save_every=2, val_split=0.0))
    assert s["status"] == "interrupted" and s["steps"] == 2 and "waited" in s["reason"]
    assert [st for st, _ in list_checkpoints(out)] == [2]
    assert verify_checkpoint(out / "checkpoints" / "step-000002") is None


def test_a_torn_last_event_line_does_not_break_resume(tiny_llama, chat_data, tmp_path, monkeypatch):
    _signal_after(monkeypatch, 3, [signal.SIGINT])
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, steps=6))
    monkeypatch.undo()
    with open(out / "events.jsonl", "ab") as f:
        f.write(b'{"event": "step", "step": 4, "lo')  # what a power cut can leave
    assert read_events(out / "events.jsonl")[-1]["event"] == "run_end"
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, resume=str(out)))
    assert s["status"] == "completed"
    lines = strict_lines(out / "events.jsonl")
    assert [e["step"] for e in lines if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]


def test_loss_events_are_finite_numbers(base_run):
    _, _, out = base_run
    losses = [e["loss"] for e in strict_lines(out / "events.jsonl") if e["event"] == "step"]
    assert len(losses) == 6 and np.isfinite(losses).all()


def test_best_survives_a_kill_between_its_two_renames(base_run, tmp_path):
    """Replacing best/ renames it to best.old, then the new one in; a kill in between
    leaves only best.old, which the next run puts back (and a later save replaces)."""
    _, _, first = base_run
    shutil.copytree(first / "best", tmp_path / "best.old")
    ckpt.restore_swapped(tmp_path / "best")
    assert verify_checkpoint(tmp_path / "best") is None and not (tmp_path / "best.old").exists()
    shutil.copytree(first / "best", tmp_path / "best.old")  # both present: the save must still work
    state, weights, moments = load_checkpoint(tmp_path / "best")
    ckpt.save_checkpoint(tmp_path / "best", weights, moments, {**state, "step": 99})
    assert load_checkpoint(tmp_path / "best")[0]["step"] == 99
    assert not (tmp_path / "best.old").exists()


def test_an_option_newer_than_the_checkpoint_counts_as_its_default():
    from toygraph.training.resume import check_resume
    fp = {"name": "m.gguf", "size": 1, "sha256_sampled": "0"}
    saved = {"options": {"lr": 1e-3}, "model_fingerprint": fp, "data_hash": "d"}
    same = {"options": {"lr": 1e-3, "precision": "f32"}, "model_fingerprint": fp, "data_hash": "d"}
    assert check_resume(saved, same, "ckpt", set()) == []
    other = {**same, "options": {"lr": 1e-3, "precision": "bf16"}}
    with pytest.raises(ResumeMismatch, match="--precision was 'f32' in the checkpoint, now 'bf16'"):
        check_resume(saved, other, "ckpt", set())


# --- round 3 (issue 31) -------------------------------------------------------------------------
def _tree(root):
    """Every file under ``root`` with its bytes: a run directory's whole state."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def test_a_resume_onto_another_architecture_is_refused_and_changes_nothing(tiny_llama,
                                                                           tiny_qwen2,
                                                                           chat_data, tmp_path):
    """Even with --allow-change model: the checkpoint's adapters were shaped for a llama."""
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0))
    before = _tree(out)
    with pytest.raises(ResumeMismatch, match="trained on a llama model; tiny-qwen2.gguf is "
                                             "qwen2 \\(another architecture\\)"):
        run_training(cfg_for(tiny_qwen2, chat_data, out, steps=2, val_split=0, resume=str(out),
                             allow_change=("model",)))
    assert _tree(out) == before


def test_a_resume_with_nothing_left_to_do_touches_nothing(tiny_llama, chat_data, tmp_path):
    out = tmp_path / "r"
    run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0))
    before = _tree(out)
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0, resume=str(out)))
    assert s["status"] == "completed" and s["reason"].startswith("nothing to do")
    assert _tree(out) == before   # no second run_end, no rewritten adapter or Modelfile


def test_a_signal_after_the_final_checkpoint_stops_at_once_and_resume_finishes(
        tiny_llama, chat_data, tmp_path, monkeypatch):
    """SIGTERM while the top level is written (here a Modelfile whose template never ends)
    stops at once, leaves no half top level, and --resume writes it from the final
    checkpoint: the same bytes as a run that was never stopped."""
    import time
    import toygraph.training.result as run_module
    real, seen = run_module.write_modelfile, []

    def hostile_modelfile(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        start = time.monotonic()
        while time.monotonic() - start < 30:   # a template that never ends (bounded here)
            seen.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(run_module, "write_modelfile", hostile_modelfile)
    out, ref = tmp_path / "r", tmp_path / "ref"
    t0 = time.monotonic()
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0))
    assert time.monotonic() - t0 < 25   # not the hostile loop's 30 s
    assert s["status"] == "interrupted" and "SIGTERM after the final checkpoint (step 2)" in s["reason"]
    assert not any((out / name).exists() for name in (*FINAL, "Modelfile"))
    assert not list(out.glob(".final.*"))
    assert verify_checkpoint(out / "checkpoints" / "step-000002") is None
    assert read_events(out / "events.jsonl")[-1]["status"] == "interrupted"
    monkeypatch.undo()
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0, resume=str(out)))
    assert s["status"] == "completed" and s["reason"] == "top level written from step-000002"
    run_training(cfg_for(tiny_llama, chat_data, ref, steps=2, val_split=0))
    for name in (*FINAL, "Modelfile"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    ends = [e for e in read_events(out / "events.jsonl") if e["event"] == "run_end"]
    assert [e["status"] for e in ends] == ["interrupted", "completed"]
    before = _tree(out)   # and once written, a further resume touches nothing
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=2, val_split=0, resume=str(out)))
    assert s["reason"].startswith("nothing to do") and _tree(out) == before


def test_finishing_stops_at_the_first_signal_once_and_at_one_already_received():
    import time
    from toygraph.training.supervisor import Signals
    with Signals() as signals:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with signals.finishing():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(20)
        assert time.monotonic() - t0 < 10
        with pytest.raises(KeyboardInterrupt):   # a signal that came before: on entering
            with signals.finishing():
                pass
    assert signals.count == 1


def test_a_step_over_many_passes_of_the_data_is_refused(tiny_llama, chat_data, tmp_path, capsys):
    with pytest.raises(ToygraphError, match=r"one step of --batch 2 x --grad-accum 100000 is "
                                            r"[\d,.]+ passes over the \d+ training examples"):
        run_training(cfg_for(tiny_llama, chat_data, tmp_path / "a", grad_accum=100000))
    assert not (tmp_path / "a").exists()
    run_training(cfg_for(tiny_llama, chat_data, tmp_path / "b", steps=1, grad_accum=40,
                         val_split=0, max_passes_per_step=0, quiet=False))
    assert "warning: one step of --batch 2 x --grad-accum 40 is" in capsys.readouterr().err


# --- round 4 (issue 39) -------------------------------------------------------------------------
def _rewrite_manifest(ck):
    """What a hand edit with a recomputed manifest leaves: a checkpoint that verifies."""
    ckpt._write_manifest(ck)
    assert verify_checkpoint(ck) is None


@pytest.mark.parametrize("edit", ["no step", "step as text", "half the tensors"])
def test_a_hand_edited_checkpoint_is_refused_not_restarted_or_reinitialised(base_run, tmp_path,
                                                                           edit):
    """It verifies (the manifest was recomputed), but a missing step restarted the run at
    0 and a partial trainable set left the rest at their initial values, silently."""
    from safetensors.numpy import load_file, save_file
    model, data, first = base_run
    out = tmp_path / "run"
    shutil.copytree(first, out)
    ck = out / "checkpoints" / "step-000006"
    if edit == "half the tensors":
        weights = load_file(str(ck / "trainable.safetensors"))
        save_file(dict(list(weights.items())[: len(weights) // 2]), str(ck / "trainable.safetensors"))
        needle = r"trainable.safetensors holds \d+ tensors, the run trains \d+; missing"
    else:
        state = json.loads((ck / "state.json").read_text())
        if edit == "no step":
            del state["step"]
            needle = "no step recorded"
        else:
            state["step"] = "6"
            needle = "step must be a count"
        (ck / "state.json").write_text(json.dumps(state))
    _rewrite_manifest(ck)
    before = snapshot(out)
    with pytest.raises(DataError, match=needle) as e:
        run_training(cfg_for(model, data, out, steps=8, resume=str(ck), allow_change=("steps",)))
    assert "\n" not in str(e.value)
    assert snapshot(out) == before


def test_a_second_ctrl_c_during_an_evaluation_stops_at_once(tiny_llama, chat_data, tmp_path,
                                                            monkeypatch):
    """A 100k-row evaluation ran 95 s more after the second Ctrl-C, and the reason then
    blamed the checkpoint write. Here the evaluation at step 3 would take 30 s."""
    import time
    from toygraph.recipes.base import Recipe
    real = Recipe.evaluate

    def evaluate(self, *a, **k):
        if self.step_index == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            start = time.monotonic()
            while time.monotonic() - start < 30:   # a long evaluation (bounded here)
                pass
        return real(self, *a, **k)
    monkeypatch.setattr(Recipe, "evaluate", evaluate)
    out = tmp_path / "r"
    t0 = time.monotonic()
    s = run_training(cfg_for(tiny_llama, chat_data, out, steps=6, eval_every=3))
    assert time.monotonic() - t0 < 20
    assert s["status"] == "interrupted" and s["steps"] == 3
    assert s["reason"] == ("SIGINT twice: aborted during the evaluation at step 3, no "
                           "checkpoint written for it")
    assert [st for st, _ in list_checkpoints(out)] == []   # step 3's state was not saved
    assert read_events(out / "events.jsonl")[-1]["status"] == "interrupted"


def test_export_never_writes_over_the_adapter_it_reads(base_run, tmp_path, capsys):
    """``export --adapter runs/x --out runs/x/adapter.gguf`` (or one file in and out)
    replaced the run's adapter with the merged model, without a word."""
    from toygraph.cli import main
    model, _, first = base_run
    run = tmp_path / "run"
    shutil.copytree(first, run)
    (tmp_path / "link.gguf").hardlink_to(run / "adapter.gguf")
    before = snapshot(run)
    for adapter, out in ((run, run / "adapter.gguf"), (run, run / "adapter_model.safetensors"),
                         (run / "adapter.gguf", run / "adapter.gguf"),
                         (run / "adapter.gguf", tmp_path / "link.gguf"),
                         (run / "checkpoints" / "step-000006",
                          run / "checkpoints" / "step-000006" / "adapter_model.safetensors")):
        code = main(["export", "--model", str(model), "--adapter", str(adapter), "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "which the export reads" in err, err
    assert snapshot(run) == before
    assert main(["export", "--model", str(model), "--adapter", str(run),
                 "--out", str(run / "merged.gguf")]) == 0   # beside it is fine
