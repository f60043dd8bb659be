"""A model file truncated under a running finetune (issue 39 item 9): the SIGBUS of the
next read of its mapping is a one-line error naming the file, the run records its end, and
its state stays resumable. (It was exit 135, no error line, no run_end.)"""
import json
import os
import shutil
import subprocess
import sys
import time

from test_run import write_chat_data
from toygraph.training.bus_error import what_changed
from toygraph.training.checkpoints import find_resumable, load_checkpoint
from toygraph.training.run_dir import LOCK_FILE, read_events


def _wait_for(path, needle: bytes, proc, limit_s=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and proc.poll() is None:
        if path.is_file() and needle in path.read_bytes():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {needle!r} in {path} (exit {proc.poll()})")


def test_a_model_truncated_under_the_run_is_a_one_line_error(tiny_llama, tmp_path):
    model, data, out = tmp_path / "model.gguf", write_chat_data(tmp_path / "d.jsonl"), tmp_path / "r"
    shutil.copyfile(tiny_llama, model)
    argv = ["finetune", "--model", str(model), "--data", str(data), "--out", str(out),
            "--steps", "100000", "--batch", "2", "--seq-len", "32", "--rank", "4",
            "--eval-every", "3", "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "toygraph.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out / "events.jsonl", b'"checkpoint"', proc)   # a checkpoint to resume from
        os.truncate(model, 4096)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    err = proc.stderr.read().strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    assert err[0].startswith(f"toygraph finetune: error: {model} was truncated to 4,096 bytes")
    assert "(SIGBUS)" in err[0] and f"--resume {out}" in err[0]
    end = read_events(out / "events.jsonl")[-1]
    assert end["event"] == "run_end" and end["status"] == "failed"
    assert "was truncated" in end["reason"]
    assert not (out / LOCK_FILE).exists()
    # resumable: with the model back, the run goes on from its newest checkpoint
    shutil.copyfile(tiny_llama, model)
    step = load_checkpoint(find_resumable(out)[0])[0]["step"]
    subprocess.run([sys.executable, "-m", "toygraph.cli", "finetune", "--config",
                    str(out / "run.yaml"), "--resume", str(out), "--steps", str(step + 1),
                    "--allow-change", "steps", "--quiet"], check=True, stdout=subprocess.DEVNULL,
                   timeout=120)
    assert read_events(out / "events.jsonl")[-1]["status"] == "completed"
    assert json.loads((out / "events.jsonl").read_text().splitlines()[-1])["steps"] == step + 1


def test_what_changed(tmp_path):
    f = tmp_path / "m"
    f.write_bytes(b"x" * 100)
    st = os.stat(f)
    was = (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)
    assert what_changed(f, was) is None
    os.truncate(f, 10)
    assert what_changed(f, was) == "was truncated to 10 bytes (it had 100)"
    f.unlink()
    assert what_changed(f, was) == "was deleted"
    f.write_bytes(b"y" * 200)
    assert what_changed(f, was) in ("was replaced by another file", "was rewritten")
