"""Tests for toygraph/data/preference.py: parsing preference pairs (errors name file:line and
the key), encoding only the final reply as targets, and the pair batches' layout."""
from __future__ import annotations

import json

import numpy as np
import pytest

from test_batches import FakeTokenizer, targets, write
from toygraph.errors import DataError
from toygraph.data.preference import encode_pairs, load_pairs, pair_batches

U, A = "user", "assistant"


def msg(role, content):
    return {"role": role, "content": content}


def test_both_shapes_parse(tmp_path):
    p = write(tmp_path, [
        json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5", "score": 1}),
        "",
        json.dumps({"messages": [msg("system", "S"), msg(U, "a"), msg(A, "b"), msg(U, "c")],
                    "chosen": msg(A, "good"), "rejected": {"content": "bad"}}),
    ])
    first, second = load_pairs(p)
    assert first.prompt == [msg(U, "2+2?")] and (first.chosen, first.rejected) == ("4", "5")
    assert first.line == 1 and second.line == 3
    assert [m["role"] for m in second.prompt] == ["system", U, A, U]
    assert (second.chosen, second.rejected) == ("good", "bad")


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "x", "chosen": "y"', "invalid JSON"),
    ('[1]', "expected a JSON object"),
    ('{"prompt": "x", "chosen": "y"}', "missing 'rejected' (keys found: chosen, prompt)"),
    ('{"prompt": "x"}', "missing 'chosen' and 'rejected'"),
    ('{"instruction": "x", "response": "y"}', "not a preference row"),
    ('{"prompt": "x", "messages": [], "chosen": "y", "rejected": "z"}', "ambiguous row"),
    ('{"prompt": 3, "chosen": "y", "rejected": "z"}', "'prompt' must be a string, found int"),
    ('{"prompt": "x", "chosen": null, "rejected": "z"}', "'chosen' must be a string, found null"),
    ('{"prompt": "x", "chosen": "y", "rejected": "\\ud800"}', "'rejected' holds a lone surrogate"),
    ('{"messages": [{"role": "user", "content": "x"}], "chosen": "y", "rejected": {"content": "z"}}',
     "'chosen' must be an object"),
    ('{"messages": [{"role": "user", "content": "x"}], "chosen": {"role": "user", "content": "y"}, '
     '"rejected": {"content": "z"}}', "'chosen.role' must be 'assistant', found 'user'"),
    ('{"messages": [{"role": "user", "content": "x"}], "chosen": {"content": "y"}, '
     '"rejected": {"content": 1}}', "'rejected.content' must be a string, found int"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], '
     '"chosen": {"content": "y"}, "rejected": {"content": "z"}}', "must end with a user turn"),
    ('{"messages": [{"role": "bot", "content": "x"}], "chosen": {"content": "y"}, '
     '"rejected": {"content": "z"}}', "messages[0] has unknown role 'bot'"),
    ('{"messages": [], "chosen": {"content": "y"}, "rejected": {"content": "z"}}', "non-empty list"),
])
def test_bad_rows_name_file_line_and_key(tmp_path, line, needle):
    p = write(tmp_path, [json.dumps({"prompt": "ok", "chosen": "a", "rejected": "b"}), line])
    with pytest.raises(DataError) as e:
        load_pairs(p)
    assert f"{p}:2" in str(e.value) and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no examples"):
        load_pairs(write(tmp_path, [""]))


def test_only_the_final_reply_is_a_target(tmp_path):
    tok = FakeTokenizer()
    p = write(tmp_path, [json.dumps({"messages": [msg(U, "a"), msg(A, "earlier"), msg(U, "c")],
                                     "chosen": msg(A, "yes"), "rejected": msg(A, "no")})])
    ds = encode_pairs(load_pairs(p), tok, 256)
    (chosen, rejected), = ds.items
    assert targets(chosen, tok) == "yes<|im_end|>" and targets(rejected, tok) == "no<|im_end|>"
    shared = tok.decode(chosen.tokens)[:-len("yes<|im_end|>")]
    assert "earlier" in shared and tok.decode(rejected.tokens) == shared + "no<|im_end|>"
    assert ds.report.kept == 1 and ds.report.target_tokens == len("yes") + 1 + len("no") + 1


def test_a_pair_with_a_reply_truncated_away_is_dropped(tmp_path):
    tok = FakeTokenizer()
    p = write(tmp_path, [json.dumps({"prompt": "x" * 40, "chosen": "a", "rejected": "b"}),
                         json.dumps({"prompt": "hi", "chosen": "a", "rejected": ""})])
    ds = encode_pairs(load_pairs(p), tok, 256)
    assert ds.report.kept == 2  # an empty reply still has its end-of-turn target
    ds = encode_pairs(load_pairs(p), tok, 8)
    assert ds.report.truncated == 2 and ds.report.kept == 2
    assert all(targets(c, tok).startswith("a") for c, _ in ds.items)


def test_pair_batches_put_chosen_rows_then_rejected_rows_of_the_same_pairs(tmp_path):
    tok = FakeTokenizer()
    rows = [json.dumps({"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"})
            for i in range(5)]
    ds = encode_pairs(load_pairs(write(tmp_path, rows)), tok, 64)
    out = pair_batches(ds.items, 2, 64, 0, shuffle=True, seed=3, epoch=1)
    assert len(out) == 3 and all(b.tokens.shape == (4, 64) for b in out)
    seen = []
    for b in out:
        for i in range(2):
            c, r = (tok.decode([t for t in b.labels[row] if t >= 0]) for row in (i, 2 + i))
            if not c:
                assert not r  # a padding pair: both rows ignored
                continue
            n = c.split()[1].split("<")[0]
            assert c == f"good {n}<|im_end|>" and r == f"bad {n}<|im_end|>"
            seen.append(int(n))
    assert sorted(seen) == list(range(5)) and seen != list(range(5))
    again = pair_batches(ds.items, 2, 64, 0, shuffle=True, seed=3, epoch=1)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(out, again))
    assert out[0].n_targets == int((out[0].labels >= 0).sum())
