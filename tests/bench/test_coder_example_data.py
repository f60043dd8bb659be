"""The typed-functions example's data (examples/typed_functions/): the committed files are
what the seeded generator writes, every training reply is in the house style and passes
its own tests (computed by a reference written apart from the reply), and the held-out
requests are not in training."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "examples" / "typed_functions"
sys.path.insert(0, str(HERE))   # the example's scripts are siblings, not a package
try:
    import house_style
    import make_data
finally:
    sys.path.remove(str(HERE))


@pytest.fixture(scope="module")
def sets():
    return make_data.make_sets()


def test_committed_files_are_what_the_generator_writes(sets):
    again = make_data.make_sets()
    assert again == sets
    train, heldout = sets
    assert (HERE / "train.jsonl").read_text(encoding="utf-8") == make_data.jsonl(train)
    assert (HERE / "heldout.jsonl").read_text(encoding="utf-8") == make_data.jsonl(heldout)
    assert make_data.make_sets(seed=1) != sets   # the seed does steer it


def test_every_reply_is_in_house_style_and_passes_its_tests(sets):
    train, heldout = sets
    replies = [(r["response"], r) for r in train] + [(r["reference"], r) for r in heldout]
    for reply, row in replies:
        assert house_style.format_problems(reply, row) == [], reply
        assert len(row["tests"]) >= 2
        assert house_style.passes(reply, row["name"], row["tests"]), reply
    assert {r["template"] for r in train} == \
        {t.key for t in make_data.TEMPLATES} - set(make_data.UNSEEN)


def test_heldout_is_disjoint_from_training(sets):
    train, heldout = sets
    asked = {r["instruction"] for r in train}
    answered = {r["response"] for r in train}
    assert not any(r["instruction"] in asked or r["reference"] in answered for r in heldout)
    unseen = [r for r in heldout if not r["seen"]]
    assert unseen and all(r["template"] in make_data.UNSEEN for r in unseen)
    assert len({r["instruction"] for r in train}) == len(train)
    assert len({r["reference"] for r in heldout}) == len(heldout)


def test_the_checks_catch_what_a_base_model_writes(sets):
    _, heldout = sets
    row = heldout[0]
    reply = row["reference"]
    fenced = f"Here is the function:\n```python\n{reply}\n```\nIt returns the value."
    v = house_style.verdict(fenced, row)
    assert v == {"format": False, "passes": False, "code_format": True, "code_passes": True,
                 "problems": ["fence: a markdown fence"], "code_problems": []}
    cut = f"Here is the function:\n```python\n{reply}\n"   # generation stopped at the fence
    assert house_style.verdict(cut, row)["code_passes"]
    assert house_style.verdict(reply, row)["format"]
    lines = reply.splitlines()
    no_doc = "\n".join([lines[0], lines[2]])
    assert house_style.format_problems(no_doc, row) != []
    untyped = lines[0].split("(")[0] + "(" + ", ".join(p for p, _ in row["params"]) + "):"
    assert house_style.format_problems("\n".join([untyped, *lines[1:]]), row) != []
    wrong = copy.deepcopy(row)
    wrong["tests"][0][1] = "not the answer"
    assert not house_style.passes(reply, row["name"], wrong["tests"])
    assert not house_style.passes_isolated("import sys\nsys.exit(0)", row["name"], row["tests"])
    assert not house_style.passes_isolated("while True: pass", row["name"], row["tests"],
                                           timeout=0.3)


def test_rows_load_as_instruction_data():
    from toygraph.data.examples import load_examples
    rows = load_examples(HERE / "train.jsonl")
    assert rows[0].messages[-1]["role"] == "assistant"
    assert rows[0].messages[-1]["content"] == json.loads(
        (HERE / "train.jsonl").read_text(encoding="utf-8").splitlines()[0])["response"]
