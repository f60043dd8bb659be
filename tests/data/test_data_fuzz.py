"""Data-file fuzzing: seeded random mutations of a valid JSONL file must each end in a
clean DataError or a valid load + encode, never another exception or a hang."""
from __future__ import annotations

import json

import numpy as np
import pytest

from toygraph.data.batches import encode_dataset, load_examples
from toygraph.errors import DataError
from toygraph.gguf.tokenizer import Tokenizer

ROWS = [{"instruction": "Capital of France?", "response": "Paris"},
        {"instruction": "Sum", "input": "2 + 2", "output": "4", "system": "be terse"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello there"}]},
        {"text": "the cat sat on the mat"}]
# Bytes that tend to break parsers: structure, escapes, invalid UTF-8 starts, control chars.
NASTY = [b'"', b"\\", b"{", b"}", b"[", b"]", b":", b",", b"\n", b"\x00", b"\xff", b"\xc3",
         b"\xed\xa0\x80", b"\\ud800", b"\\u", b"null", b"1e999", b"-", b"\t", b"\r",
         # issue 39's classes: deep nesting, terminal control characters (raw and escaped)
         b"[" * 100, b'{"a":' * 100, b"\x1b[2J\x1b[32mAll good", b"\\u001b[2J", "\u202e".encode()]
CASES = 500


def _mutate(data: bytes, rng) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 3))):
        op, i = int(rng.integers(0, 6)), int(rng.integers(0, max(len(b), 1)))
        if op == 0 and b:                      # flip bits of one byte
            b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:                          # insert a nasty token
            b[i:i] = NASTY[int(rng.integers(0, len(NASTY)))]
        elif op == 2:                          # delete a span
            del b[i:i + int(rng.integers(1, 16))]
        elif op == 3:                          # duplicate a span
            b[i:i] = b[i:i + int(rng.integers(1, 32))]
        elif op == 4:                          # truncate
            del b[i:]
        else:                                  # a random byte anywhere
            b[i:i] = bytes([int(rng.integers(0, 256))])
    return bytes(b)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_gguf(tiny_llama)


def _check_fuzz(tmp_path, tokenizer, seed: int, cases: int):
    base = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    rng = np.random.default_rng(seed)
    outcomes = {"error": 0, "loaded": 0}
    for case in range(cases):
        p = tmp_path / f"case{case}.jsonl"
        p.write_bytes(_mutate(base, rng))
        try:
            encode_dataset(load_examples(p), tokenizer, 32)
            outcomes["loaded"] += 1
        except DataError as e:
            msg = str(e)
            assert "\n" not in msg and "\x1b" not in msg and str(p) in msg, (seed, case, msg)
            outcomes["error"] += 1
        p.unlink()
    # Both kinds occur, so the mutations neither always break nor never break the file.
    assert outcomes["error"] > cases // 20 and outcomes["loaded"] > cases // 20, outcomes


def test_mutated_jsonl_gives_a_data_error_or_a_valid_load(tmp_path, tokenizer):
    _check_fuzz(tmp_path, tokenizer, 1234, CASES)


@pytest.mark.slow
def test_mutated_jsonl_long(tmp_path, tokenizer):
    """Twenty times the cases on another seed (10,000)."""
    _check_fuzz(tmp_path, tokenizer, 4321, 20 * CASES)


def test_a_fifo_a_device_or_a_folder_as_data_is_refused_without_reading(tmp_path, tokenizer):
    """A FIFO as --data hung (with or without a writer), and so would a device."""
    import os
    import signal
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    table = tmp_path / "t.csv"
    os.mkfifo(table)
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("hung")))
    signal.alarm(30)
    try:
        for path, kind in ((fifo, "FIFO"), (table, "FIFO"), ("/dev/zero", "character device"),
                           ("/dev/null", "character device"), (tmp_path, "directory")):
            with pytest.raises(DataError, match=f"not a regular file \\(a {kind}\\)|is a directory"):
                load_examples(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
