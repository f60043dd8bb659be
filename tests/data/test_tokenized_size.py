"""The memory estimate said before tokenizing a large data file, and its refusal."""
from __future__ import annotations

import importlib
import json
import sys

import pytest

import toygraph.training.tokenized_size as tokenized_size
from toygraph.data.batches import encode_dataset, load_examples
from toygraph.errors import DataError
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.training import RunConfig, run_training
from toygraph.training.tokenized_size import (ESTIMATE_FROM_ROWS, SAMPLE_ROWS,
                                              check_tokenized_memory, deep_size,
                                              estimate_tokenized_bytes, rows_bytes)
from toygraph.training.prepare import size_text


def _data(path, n):
    words = ["red", "green", "blue", "teal", "amber violet", "a much longer answer here"]
    path.write_text("".join(json.dumps({"instruction": f"Colour number {i}?",
                                        "response": words[i % len(words)]}) + "\n"
                            for i in range(n)))
    return path


def test_deep_size_counts_what_is_referenced_once():
    big = [10_000 + i for i in range(100)]           # distinct int objects
    assert deep_size(big, set()) == sys.getsizeof(big) + sum(map(sys.getsizeof, big))
    flags = [True] * 100                              # one shared object
    assert deep_size(flags, set()) == sys.getsizeof(flags) + sys.getsizeof(True)
    seen: set = set()
    assert deep_size(big, seen) > 0 and deep_size(big, seen) == 0   # counted already


def test_the_estimate_is_near_what_tokenizing_holds(tiny_llama, tmp_path):
    tok = Tokenizer.from_gguf(tiny_llama)
    rows = load_examples(_data(tmp_path / "d.jsonl", 3000))
    estimate = estimate_tokenized_bytes(lambda s: encode_dataset(s, tok, 64), rows)
    items = encode_dataset(rows, tok, 64).items
    measured = deep_size(items, set()) - sys.getsizeof(items)   # all of them, as held
    assert abs(estimate - measured) < 0.2 * measured, (estimate, measured)


def test_small_files_get_no_estimate(tmp_path):
    rows = load_examples(_data(tmp_path / "d.jsonl", ESTIMATE_FROM_ROWS - 1))
    calls = []
    assert estimate_tokenized_bytes(lambda s: calls.append(s), rows) is None and not calls
    assert SAMPLE_ROWS < ESTIMATE_FROM_ROWS


def test_the_tokenizing_line_carries_the_estimate(tiny_llama, tmp_path, capsys):
    data = _data(tmp_path / "d.jsonl", ESTIMATE_FROM_ROWS)
    run_training(RunConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / "r"),
                           steps=1, batch=2, seq_len=32, val_split=0, rank=2))
    line = next(s for s in capsys.readouterr().err.splitlines() if s.startswith("tokenizing "))
    assert "; the data takes about " in line and f"of it tokens, estimated from {SAMPLE_ROWS} rows" \
        in line, line


def test_the_rows_read_count_in_what_the_data_takes(tmp_path):
    """The estimate said 313 MiB where 10^6 short rows took 1.5 GB: the rows read (already
    in memory) were not counted, and half of that was the rows."""
    rows = load_examples(_data(tmp_path / "d.jsonl", 3000))
    measured = deep_size(rows, set()) - sys.getsizeof(rows)
    assert abs(rows_bytes([rows]) - measured) < 0.2 * measured, (rows_bytes([rows]), measured)
    assert rows_bytes([rows[:ESTIMATE_FROM_ROWS - 1]]) is None
    line = check_tokenized_memory(3 << 20, "d.jsonl", 3000, size_text, held=1 << 20)
    assert "the data takes about 4.0 MiB in memory, 3.0 MiB of it tokens" in line, line


def test_more_than_the_machine_has_is_one_line_before_tokenizing(tiny_llama, tmp_path,
                                                                 monkeypatch):
    data = _data(tmp_path / "d.jsonl", ESTIMATE_FROM_ROWS)
    monkeypatch.setattr(tokenized_size, "available_bytes", lambda: 4096)
    encoded = []
    base = importlib.import_module("toygraph.recipes.base")
    real = base.encode_dataset
    monkeypatch.setattr(base, "encode_dataset",
                        lambda ex, *a, **k: encoded.append(len(ex)) or real(ex, *a, **k))
    with pytest.raises(DataError) as e:
        run_training(RunConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / "r"),
                               steps=1, batch=2, seq_len=32, val_split=0, rank=2))
    msg = str(e.value)
    assert "\n" not in msg and "d.jsonl" in msg and "4.0 KiB available" in msg, msg
    assert "--max-examples" in msg and not (tmp_path / "r").exists()
    assert max(encoded, default=0) <= SAMPLE_ROWS   # only the sample was tokenized
    assert size_text(4096) == "4.0 KiB"
