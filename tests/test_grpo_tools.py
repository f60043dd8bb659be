"""GRPO over turns (issue 50, items 1 and 2; recipes/episodes.py): the --tools,
--max-tool-calls and --environment options, prompts rendered with the tools' schemas,
rollouts whose completions call tools or talk to an environment, and a loss over the
model's own tokens only."""
import json

import pytest

from toygraph.errors import ToygraphError
from toygraph.recipes import GRPO
from toygraph.recipes.rewards import RewardError
from toygraph.training import RunConfig

TOOLS = '''
def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: what to say
    """
    return text.upper() + "!"


def hang() -> str:
    """Never answer."""
    import time
    time.sleep(60)
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return path


def config(**kw):
    base = dict(model="m.gguf", data="d.jsonl", out="runs/x", recipe="grpo", reward=("json",))
    return RunConfig(**{**base, **kw})


def test_the_options_are_checked_naming_the_flag(tools_file, tmp_path):
    config(tools=str(tools_file), max_tool_calls=2, environment="guess").validate()
    for kw, needle in ((dict(recipe="lora", reward=(), tools=str(tools_file)),
                        "--tools is for --recipe grpo"),
                       (dict(recipe="lora", reward=(), environment="guess"),
                        "--environment is for --recipe grpo"),
                       (dict(max_tool_calls=2), "--max-tool-calls needs --tools"),
                       (dict(tools=str(tools_file), max_tool_calls=0),
                        "--max-tool-calls must be an integer >= 1"),
                       (dict(tools=str(tmp_path / "none.py")), "--tools .*none.py: no such file")):
        with pytest.raises(ToygraphError, match=needle) as e:
            config(**kw).validate()
        assert "\n" not in str(e.value)


def test_the_python_api_takes_tools_and_environments(tools_file):
    recipe = GRPO(rewards=["json"], tools=str(tools_file), max_tool_calls=2)
    assert recipe.box.names == ["shout", "hang"] and recipe.max_tool_calls == 2
    recipe.box.close()
    # an environment alone is a reward; its weight is --reward-weights' last entry
    assert GRPO(environment="guess").reward_names == ["environment"]
    both = GRPO(rewards=["json"], reward_weights=("0.5", "2"), environment="guess")
    assert both.reward_names == ["json", "environment"] and both.reward_weights == [0.5, 2.0]
    assert GRPO(rewards=["json"], reward_weights=("3",), environment="guess").reward_weights == [3.0, 1.0]
    for kw, needle in ((dict(environment="nonsense"), "expected module:Factory"),
                       (dict(rewards=[]), "GRPO needs at least one --reward"),
                       (dict(environment="guess", reward_weights=("1", "2")),
                        "one number needed, the --environment's"),
                       (dict(rewards=["json"], tools="/nonexistent/tools.py"),
                        "--tools /nonexistent/tools.py: cannot load it"),
                       (dict(rewards=["json"], tools="x.py", max_tool_calls=0),
                        "max_tool_calls must be >= 1")):
        with pytest.raises(ToygraphError, match=needle):
            GRPO(**kw)
