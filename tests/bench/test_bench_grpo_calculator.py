"""bench/grpo_calculator.py's data, tool and reward (issue 50 item 3): no model runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import grpo_calculator  # noqa: E402


def test_the_problems_are_distinct_deterministic_and_held_out_apart(tmp_path):
    rows = grpo_calculator.problems()
    assert rows == grpo_calculator.problems()
    questions = [r["question"] for r in rows]
    assert len(set(questions)) == len(rows) == grpo_calculator.TRAIN + grpo_calculator.HELD_OUT
    prompts, tools, reward, held = grpo_calculator.write_files(tmp_path)
    trained = prompts.read_text().splitlines()
    assert len(trained) == grpo_calculator.TRAIN and len(held) == grpo_calculator.HELD_OUT
    assert not {q for q in questions[grpo_calculator.TRAIN:]} & set(questions[:grpo_calculator.TRAIN])


def test_every_prompt_starts_with_the_same_demonstration_and_the_answers_are_right():
    """The demonstrated exchange (a call, its reply, an answer) is the same before every
    question, training and held-out, and none of its numbers is in a problem; the answers
    are the question's own arithmetic, and ``products`` draws the problems of runs 1-3."""
    import re
    for task in grpo_calculator.TASKS:
        for demo, shown in grpo_calculator.DEMOS.items():
            rows = grpo_calculator.problems(task, demo)
            assert all(r["prompt"][:-1] == shown for r in rows)
            assert all(r["prompt"][-1] == {"role": "user", "content": r["question"]}
                       for r in rows)
            for r in rows:
                a, b, *c = map(int, re.findall(r"\d+", r["question"]))
                assert not {a, b, *c} & grpo_calculator.DEMO_NUMBERS
                sign = -1 if ("-" in r["question"] or "subtract" in r["question"]) else 1
                assert r["answer"] == str(a * b + sign * sum(c))
    assert [r["question"] for r in grpo_calculator.problems("products", "product")] == \
        [r["question"] for r in grpo_calculator.problems("products", "none")]
    assert grpo_calculator.problems("products", "none")[grpo_calculator.TRAIN]["question"] == \
        "Compute 301 * 445."                     # run 1's first held-out problem
    demo = grpo_calculator.DEMOS["sum"]
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"]
    scope = {}
    exec(grpo_calculator.TOOLS, scope)
    expression = re.search(r'"expression": "([^"]+)"', demo[1]["content"]).group(1)
    assert scope["calculator"](expression) == demo[2]["content"]


def test_the_calculator_computes_and_refuses_what_is_not_arithmetic(tmp_path):
    scope = {}
    exec(grpo_calculator.TOOLS, scope)
    assert scope["calculator"]("347 * 829") == str(347 * 829)
    assert scope["calculator"]("(2 + 3) * -4") == "-20" and scope["calculator"]("7 / 2") == "3.5"
    try:
        scope["calculator"]("__import__('os')")
    except ValueError as e:
        assert "not arithmetic" in str(e)
    else:
        raise AssertionError("a call was evaluated")


def test_the_reward_reads_the_last_number_of_the_last_turn():
    scope = {}
    exec(grpo_calculator.REWARD, scope)
    turns = [[{"role": "assistant", "content": "<tool_call>...</tool_call>"},
              {"role": "tool", "content": "287663"},
              {"role": "assistant", "content": "347 * 829 = **287,663**"}],
             [{"role": "assistant", "content": "It is 287662."}], "no number"]
    assert scope["correct"](turns, ["287663"] * 3) == [1.0, 0.0, 0.0]


def test_the_reward_never_reads_a_tool_reply_as_the_answer():
    """An episode cut right after the tool replied (recipes/episodes.py then ends it in an
    empty model turn) has not answered, though the reply is the product; a turn that is
    one more call has not either. ``answered`` counts plain answers after a tool reply,
right or not."""
    scope = {}
    exec(grpo_calculator.REWARD, scope)
    call = {"role": "assistant", "content": '```json\n{"name": "calculator"}\n```'}
    reply = {"role": "tool", "content": "287663"}
    cut = [call, reply, {"role": "assistant", "content": ""}]
    old_style_cut = [call, reply]              # the last message a tool's
    again = [call, reply, call]
    wrong = [call, reply, {"role": "assistant", "content": "It is 5."}]
    alone = [{"role": "assistant", "content": "It is 287663."}]   # right, but no call made
    turns = [cut, old_style_cut, again, wrong, alone]
    assert scope["correct"](turns, ["287663"] * 5) == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert scope["answered"](turns) == [0.0, 0.0, 0.0, 1.0, 0.0]
