"""make_general.py's rows end at a full sentence: the demo packs whole rows, and a row
teaches the end-of-turn token after its reply."""
import json

from toygraph.demo.capitals import data_path
from toygraph.demo.make_general import PROMPTS, whole_sentences


def test_a_reply_cut_mid_sentence_ends_at_its_last_full_sentence():
    assert whole_sentences("Tea is good. Boil the water and") == "Tea is good."
    assert whole_sentences("Hi! How are") == "Hi!"
    assert whole_sentences('He said "go." Then he') == 'He said "go."'
    assert whole_sentences("Use `sorted`:\n```python\nsorted(xs)\n```\nIt retur") == \
        "Use `sorted`:\n```python\nsorted(xs)\n```"


def test_a_whole_reply_is_kept_and_a_loop_is_left_out():
    assert whole_sentences("100 divided by 4 equals 25.") == "100 divided by 4 equals 25."
    assert whole_sentences("  The answer is 8.\n") == "The answer is 8."
    assert whole_sentences("1. **1.1.1.1.1.1.1.1.1") is None     # a list's "1." ends nothing
    assert whole_sentences("a cat with a tail,\na cat with a tail,\na cat with") is None


def test_the_shipped_rows_end_at_a_full_sentence():
    rows = [json.loads(line) for line in
            data_path().with_name("general.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows and {r["instruction"] for r in rows} <= set(PROMPTS)
    assert all(whole_sentences(r["response"]) == r["response"] for r in rows)
