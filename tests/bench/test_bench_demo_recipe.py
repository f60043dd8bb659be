"""bench/demo_recipe.py's cells (issue 47 item 1), from made-up answers: no model runs."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import demo_recipe  # noqa: E402
from toygraph.demo.capitals import data_path, parse, replies_by_country  # noqa: E402

REPLIES = replies_by_country(data_path())


def _capital(country):
    return parse(REPLIES[country])["capital"]


def _answers(right=True):
    """Every bench question answered (the taught record when ``right``, else prose naming the
    capital, as the base does) and every off-task prompt in prose."""
    answers = {p.format(c): REPLIES[c] if right else f"The capital of {c} is {_capital(c)}."
               for c in demo_recipe.COUNTRIES for p in demo_recipe.PHRASINGS}
    return answers | {p: "Waves fold into foam." for p in demo_recipe.OFF_TASK}


def test_a_clean_run_passes_every_cell():
    cells = demo_recipe.cells(_answers(right=False), _answers(), REPLIES)
    n = len(demo_recipe.COUNTRIES)
    assert cells["passed"] and cells["demo3"] == "3/3" and cells["held_out"] == "36/36"
    assert cells["kept"] == f"{n}/{n}" and cells["off_task"] == f"{len(demo_recipe.OFF_TASK)}/12"


def test_a_forgotten_fact_and_a_taken_over_prompt_fail():
    """Peru answered "Quito" once (the base named Lima) and the haiku answered in the
    capitals form, as issue 47 saw: kept and off_task name them, and the run fails though
    35/36 clears the held-out bar."""
    before, after = _answers(right=False), _answers()
    after["Capital of Peru?"] = "country: Peru\ncapital: Quito"
    after["Write a haiku about the sea."] = "country: Sea\ncapital: Tokyo"
    cells = demo_recipe.cells(before, after, REPLIES)
    assert cells["held_out"] == "35/36" and cells["lost"] == ["Peru"]
    assert cells["taken_over"] == ["Write a haiku about the sea."] and not cells["passed"]


def test_kept_counts_only_capitals_the_base_named():
    """A capital the base got wrong in every phrasing is no loss when the adapter misses it
    too: it drops out of kept's denominator (the held-out count still has it)."""
    before, after = _answers(right=False), _answers()
    for p in demo_recipe.PHRASINGS:
        before[p.format("Mongolia")] = "The capital of Mongolia is Beijing."
    after["Capital of Mongolia?"] = "country: Mongolia\ncapital: Darkhan"
    cells = demo_recipe.cells(before, after, REPLIES)
    assert cells["kept"] == "11/11" and cells["held_out"] == "35/36" and cells["passed"]


def test_a_reply_cut_off_or_run_on_in_the_capitals_record_counts_as_taken_over():
    assert demo_recipe.in_capitals_record("country: Sea\ncapi")
    assert demo_recipe.in_capitals_record("country: Sea\ncapital: Tokyo")
    assert demo_recipe.in_capitals_record("country: Sea\ncapital: Tokyo\ncountry: Sky")
    assert not demo_recipe.in_capitals_record("Waves fold into foam.")


def test_the_off_task_prompts_are_held_out_of_the_training_data():
    from toygraph.demo.capitals import DATA
    trained = {json.loads(line)["instruction"] for name in DATA
               for line in data_path().with_name(name).read_text(encoding="utf-8").splitlines()}
    assert len(demo_recipe.OFF_TASK) >= 10 and not trained & set(demo_recipe.OFF_TASK)


def test_the_modes_reach_the_run(monkeypatch):
    args = demo_recipe.parse_args(["--dot", "f32", "--base-memory", "decode", "--seed", "3"])
    assert (args.dot, args.base_memory, args.seed) == (["f32"], "decode", 3)
    assert demo_recipe.parse_args([]).dot == ["int8"]
    both = demo_recipe.parse_args(["--dot", "int8", "--dot", "f32", "--dot", "int8"])
    assert both.dot == ["int8", "f32"]   # trained under the first, asked in each


def test_a_reply_that_starts_looping_is_reported_and_a_base_loop_is_not():
    """looping names an off-task reply that repeats a pair of words three times after
    training when the base's did not; a loop the base already had is not the fine-tune's."""
    before, after = _answers(right=False), _answers()
    after["Write a haiku about a mountain."] = "A mountain, a mountain, a mountain,\nA"
    before["Give me a recipe for pancakes."] = after["Give me a recipe for pancakes."] = \
        "Mix, stir; mix, stir; mix, stir."
    cells = demo_recipe.cells(before, after, REPLIES)
    assert cells["looping"] == ["Write a haiku about a mountain."]
    assert cells["passed"]   # reported beside the bars, not one of them
    assert not demo_recipe.loops("a humble soul, a humble soul, then the mountain")
