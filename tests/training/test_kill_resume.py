"""kill -9 at seeded random points of a real CLI run (also inside checkpoint writes), then
``--resume``: the per-step losses and the final adapter are bit-identical to an
uninterrupted run, and ``events.jsonl`` is strict JSON right after the kill."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from test_run import events, write_chat_data
from toygraph.training.checkpoints import find_resumable
from toygraph.cli import main
from toygraph.errors import DataError

COMMON = ["finetune", "--steps", "16", "--batch", "2", "--seq-len", "32", "--rank", "4",
          "--alpha", "8", "--targets", "q,v", "--lr", "5e-3", "--val-split", "0.25",
          "--eval-every", "4", "--seed", "7", "--quiet"]
# Checkpoints every step (most of the run is checkpoint writing), or by time only, as with
# the default options (evaluations only at the end, so nothing else saves before it).
MODES = {"every_step": ["--save-every", "1"],
         "by_time": ["--save-minutes", "0.002", "--eval-every", "100"]}


def strict_events(out):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    return [json.loads(line, parse_constant=refuse)
            for line in (out / "events.jsonl").read_text().splitlines()]


def losses_by_step(out):
    return {e["step"]: e["loss"] for e in events(out) if e["event"] == "step"}


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    data = write_chat_data(root / "chat.jsonl")
    refs = {}
    for mode, extra in MODES.items():
        out = root / f"ref-{mode}"
        assert main([*COMMON, *extra, "--model", str(tiny_llama), "--data", str(data),
                     "--out", str(out)]) == 0
        refs[mode] = out
    return tiny_llama, data, refs


def _wait_for_start(out, proc, limit_s=120):
    """Poll until the run logged run_start (imports and realize are done)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and proc.poll() is None:
        f = out / "events.jsonl"
        if f.is_file() and b"run_start" in f.read_bytes():
            return
        time.sleep(0.01)


@pytest.mark.parametrize("case", [
    pytest.param((0, "every_step")), pytest.param((1, "by_time")),
    pytest.param((2, "every_step"), marks=pytest.mark.slow),
    pytest.param((3, "by_time"), marks=pytest.mark.slow),
])
def test_kill_9_then_resume_is_bit_identical(setup, tmp_path, case):
    seed, mode = case
    model, data, refs = setup
    out = tmp_path / "run"
    argv = [*COMMON, *MODES[mode], "--model", str(model), "--data", str(data), "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "toygraph.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_start(out, proc)
    time.sleep(np.random.default_rng(seed).uniform(0.0, 3.0))
    proc.kill()
    proc.wait()
    killed = strict_events(out)  # parses line by line, right after the kill
    kinds = [e["event"] for e in killed]
    print(f"killed after {kinds.count('step')} steps, {kinds.count('checkpoint')} checkpoints")
    try:
        find_resumable(out)
        again = [*argv, "--resume", str(out)]
    except DataError:  # killed before the first checkpoint: start over
        again = [*argv, "--overwrite"]
    assert main(again) == 0
    ref = refs[mode]
    assert losses_by_step(out) == losses_by_step(ref)
    for name in ("adapter_model.safetensors", "adapter.gguf"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    assert strict_events(out)[-1]["status"] == "completed"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


# The process kills itself with SIGKILL inside its 5th checkpoint write: after the tensors,
# before the manifest (the moment a torn checkpoint would be most likely).
KILL_IN_WRITE = """
import os, signal, sys
import toygraph.training.checkpoints as c
real, calls = c._write_manifest, []
def write_manifest(folder):
    calls.append(folder)
    if len(calls) == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    real(folder)
c._write_manifest = write_manifest
from toygraph.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_inside_a_checkpoint_write_then_resume_is_bit_identical(setup, tmp_path):
    model, data, refs = setup
    out = tmp_path / "run"
    argv = [*COMMON, *MODES["every_step"], "--model", str(model), "--data", str(data),
            "--out", str(out)]
    proc = subprocess.run([sys.executable, "-c", KILL_IN_WRITE, *argv],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert proc.returncode == -9
    partial = [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert partial and not (partial[0] / "manifest.json").exists()  # the torn write is there
    strict_events(out)
    assert main([*argv, "--resume", str(out)]) == 0
    assert losses_by_step(out) == losses_by_step(refs["every_step"])
    assert (out / "adapter_model.safetensors").read_bytes() == \
        (refs["every_step"] / "adapter_model.safetensors").read_bytes()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
