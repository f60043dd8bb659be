"""Several data files mixed by weight (toygraph/data/mixing.py): the --data specs, the
rows each file gives, and a mixed run of ShareGPT, prompt/completion and tool-call files
that trains, names each file's share and resumes bit-exactly."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from test_run import _stop_after, events
from test_run import cfg_for as one_file_cfg
from toygraph.data.mixing import (DataSpec, mix_counts, mix_rows, mix_summary, parse_data_spec,
                                  parse_data_specs)
from toygraph.errors import DataError
from toygraph.training import run_training

QWEN2_5 = Path(__file__).resolve().parents[2] / "fixtures" / "templates" / "qwen2_5.jinja"


def test_specs(tmp_path):
    odd = tmp_path / "odd:0.5"   # a file whose name ends like a weight is a path
    odd.write_text("{}\n")
    assert parse_data_spec(str(odd)) == DataSpec(str(odd))
    assert parse_data_spec("a.jsonl:0.7") == DataSpec("a.jsonl", 0.7)
    assert parse_data_spec("a.jsonl:3") == DataSpec("a.jsonl", 3.0)
    assert parse_data_spec("a.jsonl") == DataSpec("a.jsonl")
    assert parse_data_spec("C:data.jsonl") == DataSpec("C:data.jsonl")   # not a number: a path
    assert parse_data_specs("a.jsonl") == [DataSpec("a.jsonl")]
    for bad, message in (("a.jsonl:0", "finite number > 0"), ("a.jsonl:nan", "finite number > 0"),
                         ("a.jsonl:-1", "finite number > 0")):
        with pytest.raises(DataError, match=message):
            parse_data_spec(bad)
    with pytest.raises(DataError, match="--data b.jsonl: give every file a weight"):
        parse_data_specs(["a.jsonl:0.7", "b.jsonl"])
    with pytest.raises(DataError, match="given twice"):
        parse_data_specs(["a.jsonl:0.7", "./a.jsonl:0.3"])


def test_counts_follow_the_shares():
    assert mix_counts([100, 20], None) == [100, 20]          # no weights: concatenated
    assert mix_counts([100, 20], [0.7, 0.3]) == [84, 36]     # 120 rows, 70% / 30%
    assert mix_counts([100, 20], [7, 3]) == [84, 36]         # weights are relative
    assert mix_counts([100, 20], [1, 1e-9]) == [120, 1]      # every weighted file gives a row


def test_huge_weights_keep_their_proportions():
    """--data a:1e308 --data b:1e308 trained on 2 rows instead of 72: the weights' sum
    overflowed to inf and every share to 0."""
    assert mix_counts([36, 36], [1e308, 1e308]) == [36, 36]
    assert mix_counts([100, 20], [7e307, 3e307]) == [84, 36]
    assert mix_summary([DataSpec("a.jsonl", 1e308), DataSpec("b.jsonl", 1e308)], [36, 36],
                       seed=0)[1][0]["share"] == 0.5


def test_mix_samples_down_and_repeats_up_deterministically():
    a, b = [f"a{i}" for i in range(100)], [f"b{i}" for i in range(20)]
    rows = mix_rows([a, b], [0.7, 0.3], seed=5)
    count = Counter(rows)
    assert sum(r.startswith("a") for r in rows) == 84 and len({r for r in rows if r[0] == "a"}) == 84
    # b gives 36 of its 20 rows: each once, and 16 of them a second time
    assert sum(r.startswith("b") for r in rows) == 36
    assert sorted(count[r] for r in b) == [1] * 4 + [2] * 16
    assert mix_rows([a, b], [0.7, 0.3], seed=5) == rows     # a pure function of the seed
    assert mix_rows([a, b], [0.7, 0.3], seed=6) != rows
    assert mix_rows([a, b], None, seed=5) == a + b


def test_summary_names_each_share():
    specs = [DataSpec("x/a.jsonl", 0.7), DataSpec("y/b.jsonl", 0.3)]
    line, records = mix_summary(specs, [100, 20], seed=5)
    assert line == ("data mix of 2 files, 120 training rows (drawn once, --seed 5): a.jsonl 70% "
                    "(84 rows: a sample of 84 of its 100); b.jsonl 30% (36 rows: 1.80x of its 20)")
    assert [r["mixed_rows"] for r in records] == [84, 36]


def cfg_for(model, data: list[str], out, **kw):
    return dataclasses.replace(one_file_cfg(model, data[0], out, **kw), data=tuple(data))


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mixed_files(tmp_path):
    tool = {"type": "function", "function": {"name": "double", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}
    sharegpt = write(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "human", "value": f"say {i}"},
                           {"from": "gpt", "value": f"the number is {i}"}]} for i in range(12)])
    completions = write(tmp_path / "pc.jsonl", [
        {"prompt": f"count to {i}:", "completion": " " + " ".join(map(str, range(i)))} if i % 2 else
        {"prompt": [{"role": "user", "content": f"twice {i}?"}],
         "completion": [{"role": "assistant", "content": f"{2 * i}"}]} for i in range(1, 9)])
    tools = write(tmp_path / "tools.jsonl", [
        {"messages": [{"role": "user", "content": f"double {i}"},
                      {"role": "assistant", "tool_calls": [
                          {"type": "function", "function": {"name": "double",
                                                            "arguments": json.dumps({"n": i})}}]},
                      {"role": "tool", "name": "double", "content": str(2 * i)},
                      {"role": "assistant", "content": f"it is {2 * i}"}], "tools": [tool]}
        for i in range(6)])
    return [f"{sharegpt}:0.5", f"{completions}:0.3", f"{tools}:0.2"]


def test_a_weighted_mix_trains_names_its_shares_and_resumes_exactly(tiny_llama, tmp_path, capsys):
    data = mixed_files(tmp_path)
    kw = dict(steps=6, save_every=3, val_split=0.2, template=str(QWEN2_5), seq_len=128)
    run_training(cfg_for(tiny_llama, data, tmp_path / "full", quiet=False, **kw))
    said = capsys.readouterr().err
    line = next(l for l in said.splitlines() if l.startswith("data mix of 3 files"))
    assert "sharegpt.jsonl 50%" in line and "pc.jsonl 30%" in line and "tools.jsonl 20%" in line
    start = events(tmp_path / "full")[0]
    assert [round(m["share"], 1) for m in start["data_mix"]] == [0.5, 0.3, 0.2]
    assert start["config"]["data"] == data
    straight = [e["loss"] for e in events(tmp_path / "full") if e["event"] == "step"]
    assert len(straight) == 6 and all(0 < loss < 20 for loss in straight)

    part = tmp_path / "part"
    _stop_after(cfg_for(tiny_llama, data, part, **kw), 3)
    run_training(cfg_for(tiny_llama, data, part, resume=str(part / "checkpoints" / "step-000003"), **kw))
    losses = {e["step"]: e["loss"] for e in events(part) if e["event"] == "step"}
    assert [losses[s] for s in range(1, 7)] == straight

    # another weight is another mix: the checkpoint says so
    other = data[:2] + [data[2].replace(":0.2", ":0.4")]
    with pytest.raises(Exception, match="--data was data with sha256"):
        run_training(cfg_for(tiny_llama, other, part, resume=str(part), **kw))
