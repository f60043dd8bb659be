"""Parquet and CSV data files (toygraph/data/tables.py) parse as the same rows as JSONL,
through the optional ``datasets`` library; without it a one-line error names the file."""
from __future__ import annotations

import json
import sys

import pytest

from toygraph.data.examples import load_examples
from toygraph.errors import DataError

ROWS = [
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather",
                                                        "arguments": json.dumps({"city": "Paris"})}}]},
                  {"role": "tool", "content": "22C", "name": "get_weather", "tool_calls": None},
                  {"role": "assistant", "content": "It is 22C.", "tool_calls": None}]},
    {"messages": [{"role": "user", "content": "hi", "tool_calls": None},
                  {"role": "assistant", "content": "hello", "tool_calls": None}]},
]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The tables datasets converts go to the test's directory, not the user's cache."""
    try:
        import datasets
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def test_parquet_rows_match_jsonl_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    from_jsonl, from_parquet = load_examples(jsonl), load_examples(parquet)
    assert [e.messages for e in from_parquet] == [e.messages for e in from_jsonl]
    assert [e.line for e in from_parquet] == [1, 2]
    assert from_parquet[0].messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # converted into a cache of the read's own, which goes with it (test_a_csv_rewritten_...)
    assert not (tmp_path / "hf-cache").exists() or not list((tmp_path / "hf-cache").rglob("*.arrow"))


def test_a_csv_rewritten_with_its_mtime_kept_is_read_anew(tmp_path):
    """datasets' cache knows a file by path and mtime: a rewrite that keeps the mtime (a
    copy with -p, a restore) was read stale, while the checkpoint's data_hash recorded the
    new bytes."""
    import os
    pytest.importorskip("datasets")
    p = tmp_path / "d.csv"
    p.write_text("instruction,response\nQ1,A1\nQ2,A2\n")
    mtime = os.stat(p).st_mtime_ns
    first = load_examples(p)
    p.write_text("instruction,response\nQ1,B1\nQ2,B2\n")   # the same size
    os.utime(p, ns=(mtime, mtime))
    answers = [[m["content"] for m in e.messages if m["role"] == "assistant"]
               for e in (*first, *load_examples(p))]
    assert answers == [["A1"], ["A2"], ["B1"], ["B2"]]


def test_csv_flat_rows_and_errors_name_the_row(tmp_path):
    pytest.importorskip("datasets")
    good = tmp_path / "d.csv"
    good.write_text('prompt,completion\n"The sky is"," blue."\n"Grass is"," green."\n')
    a, b = load_examples(good)
    assert (a.prompt, a.completion, b.prompt, b.line) == ("The sky is", " blue.", "Grass is", 2)
    bad = tmp_path / "bad.csv"
    bad.write_text("question,answer\nx,y\n")
    with pytest.raises(DataError, match=r"bad.csv:1: unknown row shape \(keys found: answer, question\)"):
        load_examples(bad)


def test_without_datasets_the_error_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"d.parquet: reading .parquet files needs the datasets "
                                        r"package \(pip install datasets\), or convert it to JSONL$"):
        load_examples(p)
