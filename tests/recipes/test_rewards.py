"""GRPO's reward functions (recipes/rewards.py): each built-in one, weights, Python
functions with TRL's signature from a module or a file, the JSON Schema subset, and the
one-line errors of a reward that breaks its contract."""
import json

import numpy as np
import pytest

from toygraph.recipes.rewards import (RewardError, check_schema, normalise, parse_rewards,
                                      score, valid)

COMPLETIONS = ['{"capital": "Paris"}', "paris.", "The capital is 42", '{"capital": "Rome"}',
               "  PARIS  "]
FIELDS = {"capital": ["Paris", "Paris", "Paris", "Paris", "París"]}
PROMPTS = ["q"] * 5


def _score(*specs, completions=COMPLETIONS, fields=FIELDS, weights=None):
    return score(parse_rewards(specs, weights), PROMPTS[:len(completions)], completions, fields)


def test_the_built_in_rewards():
    got = _score("regex:[0-9]", "regex:^\\{.*\\}$", "json", "exact:capital", "length:5:8")
    assert got[:, 0].tolist() == [0, 0, 1, 0, 0]
    assert got[:, 1].tolist() == [1, 0, 0, 1, 0]
    assert got[:, 2].tolist() == [1, 0, 0, 1, 0]
    assert got[:, 3].tolist() == [1, 1, 0, 0, 0]   # París is not Paris: accents are kept
    assert got[:, 4].tolist() == [0, 1, 0, 0, 0]


def test_exact_normalisation():
    assert normalise("  The   Capital.  ") == "the capital"
    assert normalise('"Paris"') == "paris" and normalise("ＰＡＲＩＳ") == "paris"   # NFKC
    assert normalise(12) == "12"


def test_json_schema(tmp_path):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "minLength": 2}},
              "required": ["capital"], "additionalProperties": False, "title": "answer"}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    got = _score(f"json-schema:{f}", completions=['{"capital": "Paris"}', '{"capital": "P"}',
                                                  '{"capital": "Paris", "x": 1}', "Paris",
                                                  '{"city": "Paris"}'])
    assert got[:, 0].tolist() == [1, 0, 0, 0, 0]
    assert valid([1, 2], {"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    assert not valid(True, {"type": "integer"}) and valid(3, {"type": "number", "minimum": 3})
    assert check_schema({"oneOf": []}).startswith("#: keyword 'oneOf' is not supported")
    f.write_text(json.dumps({"properties": {"a": {"anyOf": []}}}))
    with pytest.raises(RewardError, match="#/properties/a: keyword 'anyOf' is not supported"):
        parse_rewards([f"json-schema:{f}"])


def test_weights_and_nan_for_none(tmp_path):
    module = tmp_path / "r.py"
    module.write_text("def half(prompts, completions, capital, completion_ids=None, **kw):\n"
                      "    return [0.5 if c.startswith('{') else None for c in completions]\n")
    got = _score("json", f"{module}:half", weights=["2", "1"])
    assert np.isnan(got[1, 1]) and got[0].tolist() == [1.0, 0.5]
    r = parse_rewards(["json", f"{module}:half"], ["2", "1"])
    assert [x.weight for x in r] == [2.0, 1.0]


def test_a_dotted_module_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def n(prompts, completions, **kw):\n"
                                      "    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    assert _score("mine:n", completions=["ab", "abc"], fields={})[:, 0].tolist() == [2, 3]


def test_conversational_completions_are_messages():
    got = _score("exact:capital", completions=[[{"role": "assistant", "content": "Paris"}]],
                 fields={"capital": ["paris"]})
    assert got.tolist() == [[1.0]]


@pytest.mark.parametrize("specs, weights, needle", [
    ([], None, "GRPO needs at least one --reward"),
    (["regex:("], None, "--reward regex:(: not a regular expression"),
    (["length:9:2"], None, "expected length:MIN:MAX with 0 <= MIN <= MAX"),
    (["frobnicate"], None, "--reward 'frobnicate': not a reward"),
    (["no_such_module_x:f"], None, "--reward no_such_module_x:f: cannot import it"),
    (["json-schema:/no/such.json"], None, "json-schema:/no/such.json: cannot read it"),
    (["json", "json"], ["1"], "1 finite numbers needed, one per --reward (2)"),
    (["json"], ["x"], "--reward-weights must be numbers"),
])
def test_bad_specs_are_one_line_errors(specs, weights, needle):
    with pytest.raises(RewardError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_rewards(specs, weights)


def test_a_reward_breaking_its_contract(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
                      "def text(prompts, completions, **kw):\n    return ['1'] * len(completions)\n"
                      "def gen(prompts, completions, **kw):\n    return (x for x in completions)\n")
    for name, needle in (("nan", "returned nan for completion 0"),
                         ("text", "returned '1' for completion 0"),
                         ("gen", "returned 'generator' for 5 completions")):
        with pytest.raises(RewardError, match=needle):
            _score(f"{module}:{name}")
    with pytest.raises(RewardError, match="reward exact:city failed: KeyError"):
        _score("exact:city")


# --- Python rewards run in a process of their own (issue 39) ------------------------------------
HOSTILE = """
import os, signal, subprocess, sys, time
def exits(prompts, completions, **kw):
    sys.exit(0)
def exits_hard(prompts, completions, **kw):
    os._exit(3)
def forks(prompts, completions, **kw):
    os.fork()
    return [1.0] * len(completions)
def hangs(prompts, completions, **kw):
    time.sleep(60)
def huge(prompts, completions, **kw):
    return [10 ** 400] * len(completions)
def ignores_signals(prompts, completions, **kw):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return [0.5] * len(completions)
def runs_a_program(prompts, completions, **kw):
    print("a reward may print")
    ok = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout
    return [float(ok.strip() == b"1")] * len(completions)
"""


@pytest.fixture
def hostile(tmp_path):
    module = tmp_path / "hostile.py"
    module.write_text(HOSTILE)
    return module


@pytest.mark.parametrize("name, needle", [
    ("exits", r"reward .*hostile.py:exits called sys.exit\(0\); a reward must return its values"),
    ("exits_hard", r"reward .*:exits_hard ended the process rewards run in \(exit status 3\)"),
    ("forks", r"reward .*:forks called os.fork\(\); rewards must not fork"),
    ("huge", r"reward .*:huge returned an integer of 401 digits for completion 0: a finite number"),
])
def test_a_python_reward_cannot_end_or_copy_the_run(hostile, name, needle):
    """sys.exit(0) in a reward ended a GRPO run with exit 0 and no run_end; os.fork made 16
    copies of the run in one folder; 10**400 was an OverflowError traceback."""
    with pytest.raises(RewardError, match=needle) as e:
        _score(f"{hostile}:{name}")
    assert "\n" not in str(e.value)


def test_a_hung_reward_is_stopped_after_its_time_limit(hostile):
    import time
    rewards = parse_rewards([f"{hostile}:hangs"], timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"hostile.py:hangs did not return within 0.5 s "
                                          r"\(--reward-timeout\)"):
        score(rewards, PROMPTS, COMPLETIONS, FIELDS)
    assert time.monotonic() - t0 < 10
    with pytest.raises(RewardError, match="stopped by an earlier error"):
        score(rewards, PROMPTS, COMPLETIONS, FIELDS)


def test_a_reward_cannot_replace_the_runs_signal_handlers(hostile):
    import signal
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert _score(f"{hostile}:ignores_signals")[:, 0].tolist() == [0.5] * 5
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_reward_may_print_and_run_programs(hostile):
    assert _score(f"{hostile}:runs_a_program")[:, 0].tolist() == [1.0] * 5


@pytest.mark.parametrize("schema, needle", [
    ({"type": "strnig"}, r"#: 'type' must be one of object, array, string"),
    ({"properties": {"a": {"type": ["string", "nmber"]}}}, r"#/properties/a: 'type' must be"),
    ({"minLength": -1}, r"'minLength' must be an integer >= 0, got -1"),
    ({"pattern": "("}, r"'pattern' '\(' is not a regular expression"),
    ({"required": "capital"}, r"'required' must be a list of property names"),
    ({"maximum": float("nan")}, r"NaN is not a JSON number"),   # the bounded reader's refusal
    ({"maximum": "5"}, r"'maximum' must be a finite number"),
])
def test_a_json_schema_is_itself_checked_first(tmp_path, schema, needle):
    """A typo in a keyword's value matched nothing: reward 0 for every completion, forever."""
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    with pytest.raises(RewardError, match=needle):
        parse_rewards([f"json-schema:{f}"])
