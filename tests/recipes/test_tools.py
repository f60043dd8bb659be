"""GRPO's tools (recipes/tools.py): calls parsed in each template format, run in a process
of their own, and every way a tool can go wrong a one-line reply, never a stuck run."""
import json
import time

import pytest

from toygraph.recipes.rewards import RewardError
from toygraph.recipes.tools import ToolBox, ToolCall, ToolCallError, parse_tool_calls

TOOLS = '''
import os, sys, time
from math import sqrt   # imported: not a tool


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def shout(text: str, times: int = 1) -> str:
    """The text in capitals."""
    return " ".join([text.upper()] * times)


def fail(x: float) -> float:
    """Raise."""
    raise ValueError(f"no\\n{x}")


def hang(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "woke"


def huge() -> str:
    """Much text."""
    return "x" * 100000


def leave() -> str:
    """sys.exit."""
    sys.exit(3)


def crash() -> str:
    """os._exit."""
    os._exit(9)


def table() -> dict:
    """A value that is not text."""
    return {"rows": [1, 2]}


def _helper():
    return 0
'''


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    b = ToolBox(path, timeout=1.0, max_chars=50)
    yield b
    b.close()


@pytest.mark.parametrize("style, text", [
    ("qwen", 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
             '</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'),
    ("qwen", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'),   # stopped at the tag
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ("json", '{"name": "add", "arguments": {"a": 2, "b": 3}}'),
    ("json", '```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```\nThat adds them.'),
    ("json", '  ```\n{"name": "add", "arguments": {"a": 2, "b": 3}}'),   # stopped in the fence
])
def test_a_call_in_each_format_is_parsed_and_run(box, style, text):
    calls = parse_tool_calls(text, style)
    assert calls == [ToolCall("add", {"a": 2, "b": 3})]
    assert box.reply(calls[0]) == "5"


def test_several_calls_and_none():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>')
    assert parse_tool_calls(text, "qwen") == [ToolCall("add", {"a": 1, "b": 2}),
                                              ToolCall("shout", {"text": "hi"})]
    two = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "huge", "parameters": {}}'
    assert [c.name for c in parse_tool_calls(two, "llama3")] == ["add", "huge"]
    assert parse_tool_calls("The answer is 5.", "qwen") == []
    assert parse_tool_calls("The answer is 5.", "llama3") == []
    assert parse_tool_calls("The answer is 5.", "json") == []
    # json: only a turn that opens with the object calls; an answer quoting one does not
    assert parse_tool_calls('It is {"name": "add"}.', "json") == []
    assert parse_tool_calls("```python\nprint(5)\n```", "json") == []
    lines = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "shout", "arguments": {}}'
    assert [c.name for c in parse_tool_calls(lines, "json")] == ["add", "shout"]


def test_schemas_come_from_hints_and_docstrings(box):
    assert box.names == ["add", "shout", "fail", "hang", "huge", "leave", "crash", "table"]
    add = box.schemas[0]["function"]
    assert add == {"name": "add", "description": "Add two integers.",
                   "parameters": {"type": "object", "required": ["a", "b"], "properties": {
                       "a": {"type": "integer", "description": "the first"},
                       "b": {"type": "integer", "description": "the second"}}}}
    assert box.schemas[1]["function"]["parameters"]["required"] == ["text"]


@pytest.mark.parametrize("text, reply", [
    ('<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>',
     "error: tool call 1 is not JSON (Expecting property name enclosed in double quotes at "
     "character 30)"),
    ('<tool_call>{"arguments": {}}</tool_call>', "error: tool call 1 names no tool"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     "error: tool call 1 (add): its arguments are not a JSON object"),
])
def test_malformed_calls_become_one_line_replies(box, text, reply):
    [call] = parse_tool_calls(text, "qwen")
    assert isinstance(call, ToolCallError)
    assert box.reply(call).startswith(reply) and "\n" not in box.reply(call)


@pytest.mark.parametrize("call, reply", [
    (ToolCall("nope", {}), "error: no tool named 'nope' (tools: add, shout, fail, hang, huge, "),
    (ToolCall("fail", {"x": 1.5}), "error: tool fail raised ValueError: no 1.5"),
    (ToolCall("add", {"a": 1}), "error: tool add raised TypeError: add() missing 1 required"),
    (ToolCall("leave", {}), "error: tool leave called sys.exit(3)"),
    (ToolCall("crash", {}), "error: tool crash ended the process tools run in (exit status 9)"),
    (ToolCall("huge", {}), "x" * 50 + "... (99950 more characters cut)"),
    (ToolCall("table", {}), '{"rows": [1, 2]}'),
])
def test_a_broken_tool_is_a_one_line_reply_and_the_next_call_works(box, call, reply):
    text = box.reply(call)
    assert text.startswith(reply) and "\n" not in text
    assert box.reply(ToolCall("add", {"a": 2, "b": 2})) == "4"   # a fresh worker if need be


def test_a_hanging_tool_is_stopped_at_its_time_limit(box):
    t0 = time.monotonic()
    text = box.reply(ToolCall("hang", {"seconds": 60}))
    assert time.monotonic() - t0 < 5
    assert text.startswith("error: tool hang did not return within 1 s (the tools' time limit); "
                           "its process was stopped")
    assert box.reply(ToolCall("hang", {"seconds": 0})) == "woke"


def test_a_tools_file_that_cannot_load_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    '''no hint'''\n    return x\n")
    with pytest.raises(RewardError, match=r"^--tools .*bad.py: cannot load it \(TypeError: tool f: "
                                          r"argument 'x' needs a type hint"):
        ToolBox(bad)
    with pytest.raises(RewardError, match="cannot load it .FileNotFoundError"):
        ToolBox(tmp_path / "missing.py")


def test_replies_are_json_or_text_the_template_can_render(box):
    assert json.loads(box.reply(ToolCall("table", {}))) == {"rows": [1, 2]}
    assert box.reply(ToolCall("shout", {"text": "hi", "times": 2})) == "HI HI"
