"""Every structured file toygraph reads goes through toygraph/bounded.py: checkpoint
manifests and state, run logs, json-schema reward files, Ollama manifests, adapter
configs, run files. Each gets hostile input (deep nesting, alias bombs, control
characters, FIFOs and devices), by hand and by a seeded fuzzer, and must answer with its
own one-line error or a valid value -- never a traceback or a hang."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from toygraph.adapters.files import read_peft, save_peft
from toygraph.errors import ToygraphError
from toygraph.models import stores
from toygraph.models.model import GGUFModel
from toygraph.recipes.rewards import RewardError, parse_rewards
from toygraph.training.checkpoints import load_checkpoint, save_checkpoint, verify_checkpoint
from toygraph.training.run_config import RunConfig
from toygraph.training.run_dir import RunError, read_events
from toygraph.training.run_file import load_run_file, write_run_file

DEEP = "[" * 100_000 + "]" * 100_000
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}},
          "required": ["city"]}


@pytest.fixture
def watchdog():
    """A hang is a failure, not a stuck suite: SIGALRM after 60 s."""
    def expired(*_):
        raise TimeoutError("hung: a reader blocked or ran away")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _checkpoint(tmp_path) -> Path:
    ck = tmp_path / "run" / "checkpoints" / "step-1"
    save_checkpoint(ck, {"w": np.ones(3, np.float32)}, {"m": np.zeros(3, np.float32)},
                    {"step": 1, "status": "running"})
    assert verify_checkpoint(ck) is None
    return ck


def test_a_deep_checkpoint_manifest_or_state_is_a_reason_not_a_traceback(tmp_path):
    ck = _checkpoint(tmp_path)
    (ck / "manifest.json").write_text('{"state.json": ' + DEEP + "}")
    assert "JSON nested 100001 levels deep" in verify_checkpoint(ck)
    (ck / "manifest.json").write_text(json.dumps(
        {"state.json": 1, "trainable.safetensors": [], "optimizer.safetensors": "x"}))
    assert "gives 'state.json' no size and sha256" in verify_checkpoint(ck)
    (ck / "state.json").write_text(DEEP)
    with pytest.raises(ToygraphError, match="unreadable checkpoint: .*nested 100000 levels"):
        load_checkpoint(ck)


def test_a_deep_event_line_is_one_line_or_a_torn_tail(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"event": "run_start"}\n' + DEEP + "\n" + '{"event": "step"}\n')
    with pytest.raises(RunError, match=r"events.jsonl:2: not a JSON event"):
        read_events(log)
    log.write_text('{"event": "run_start"}\n' + DEEP + "\n")   # the last line: torn, skipped
    assert read_events(log) == [{"event": "run_start"}]


def test_a_json_schema_reward_file_is_read_within_bounds(tmp_path, watchdog):
    fifo = tmp_path / "schema.fifo"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    for path, needle in (("/dev/zero", "not a regular file (a character device)"),
                         (fifo, "not a regular file (a FIFO)"),
                         (deep, "JSON nested 100000 levels deep")):
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match=re.escape(needle)) as e:
            parse_rewards([f"json-schema:{path}"])
        assert time.perf_counter() - t0 < 5 and "\n" not in str(e.value)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SCHEMA))
    assert parse_rewards([f"json-schema:{good}"])[0].name == f"json-schema:{good}"


# --- the fuzzer: seeded mutations of each reader's valid file ----------------------------------
# The classes issue 39 adds to the byte-level ones: deep nesting, YAML aliases and bombs,
# terminal control characters; and the file replaced by a FIFO or a device.
NASTY = [b'"', b"\\", b"{", b"}", b"[", b"]", b":", b",", b"\n", b"\x00", b"\xff", b"NaN",
         b"1e999", b"-", b"&a", b"*a", b"!!python/object:os.system", b"[" * 300, b"{" * 300,
         b'{"a":' * 200, b"- " * 300, b"\x1b[2J\x1b[32mAll good", "\u202e".encode(),
         b"&a [x, x, x, x, x, x, x, x, x]", b"[*a, *a, *a, *a, *a, *a, *a, *a, *a]"]
BOMB = b"x: &a [l, l, l, l, l, l, l, l, l]\n" + b"".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n".encode() for p, n in zip("abcdefgh", "bcdefghi"))
CASES = 60   # per reader: 5 readers, a few ms each


def _mutate(data: bytes, rng) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 3))):
        op, i = int(rng.integers(0, 5)), int(rng.integers(0, max(len(b), 1)))
        if op == 0 and b:
            b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:
            b[i:i] = NASTY[int(rng.integers(0, len(NASTY)))]
        elif op == 2:
            del b[i:i + int(rng.integers(1, 16))]
        elif op == 3:
            b[i:i] = BOMB if rng.random() < 0.2 else b[i:i + int(rng.integers(1, 32))]
        else:
            del b[i:]
    return bytes(b)


def _readers(tmp_path, tiny_llama):
    """{name: (the file, its valid bytes, read(file) -> anything)} of every reader."""
    cfg = GGUFModel(tiny_llama).config
    name = "blk.0.attn_q.weight"
    rng = np.random.default_rng(0)
    adapter = save_peft(tmp_path / "adapter", {name: (rng.normal(size=(2, cfg.n_embd)).astype(np.float32),
                                                      rng.normal(size=(cfg.n_embd, 2)).astype(np.float32))},
                        cfg, rank=2, alpha=4, targets=["q"])
    run_dir = tmp_path / "rundir"
    run_dir.mkdir()
    write_run_file(RunConfig(model=str(tiny_llama), data="d.jsonl", out=str(run_dir), rank=4), run_dir)
    ck = _checkpoint(tmp_path)
    store = tmp_path / "ollama"
    manifest = store / "manifests/registry.ollama.ai/library/tiny/latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": stores.MEDIA + "model", "digest": "sha256:" + "0" * 64, "size": 10}]}))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    return {
        "adapter_config.json": (adapter / "adapter_config.json", lambda p: read_peft(p.parent, cfg)),
        "run.yaml": (run_dir / "run.yaml", load_run_file),
        "checkpoint manifest": (ck / "manifest.json", lambda p: _verified(p.parent)),
        "ollama manifest": (manifest, lambda p: stores.ollama_layers(p, "m", store)),
        "json schema": (schema, lambda p: parse_rewards([f"json-schema:{p}"])),
    }


def test_structured_files_fuzz_to_their_own_error_or_a_value(tmp_path, tiny_llama, watchdog):
    rng = np.random.default_rng(39)
    for what, (path, read) in _readers(tmp_path, tiny_llama).items():
        valid = path.read_bytes()
        read(path)   # the valid file reads
        outcomes = {"error": 0, "read": 0}
        for case in range(CASES):
            path.write_bytes(_mutate(valid, rng))
            t0 = time.perf_counter()
            try:
                read(path)
                outcomes["read"] += 1
            except ToygraphError as e:
                msg = str(e)
                assert "\n" not in msg and "\x1b" not in msg and len(msg) < 1000, (what, case, msg)
                outcomes["error"] += 1
            assert time.perf_counter() - t0 < 5, (what, case, "slow")
        assert outcomes["error"] > CASES // 10, (what, outcomes)
        path.unlink()
        os.mkfifo(path)   # a FIFO where the file was: refused, never opened to block
        with pytest.raises(ToygraphError, match="FIFO|no manifest.json"):   # (not a file)
            read(path)


def _verified(checkpoint: Path):
    """verify_checkpoint answers with a reason: raised here, as the other readers do."""
    reason = verify_checkpoint(checkpoint)
    if reason is not None:
        raise ToygraphError(reason)
