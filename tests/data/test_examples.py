"""The JSONL row shapes of toygraph/data/examples.py beyond instruction/chat/text: ShareGPT,
TRL's prompt/completion (strings or messages), tool calls and a per-row tools list; and
the one-line errors naming file:line for what they refuse."""
from __future__ import annotations

import json

import pytest

from toygraph.data.examples import load_examples
from toygraph.errors import DataError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                 encoding="utf-8")
    return p


def test_sharegpt_speakers_become_roles(tmp_path):
    p = write(tmp_path, [
        {"conversations": [{"from": "system", "value": "Be brief."},
                           {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
        {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}],
         "system": "Top-level system."},
        {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ])
    a, b, c = load_examples(p)
    assert a.messages == [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert b.messages[0] == {"role": "system", "content": "Top-level system."}
    assert [m["role"] for m in b.messages] == ["system", "user", "assistant"]
    assert c.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert (a.line, b.line, c.line) == (1, 2, 3)


def test_sharegpt_unknown_speaker_is_refused_with_its_line(tmp_path):
    p = write(tmp_path, [
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "bard", "value": "b"}]},
    ])
    with pytest.raises(DataError) as e:
        load_examples(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: conversations[1] has unknown 'from' 'bard'") and "\n" not in msg
    assert "human" in msg and "gpt" in msg


def test_prompt_completion_strings_and_messages(tmp_path):
    p = write(tmp_path, [
        {"prompt": "The sky is", "completion": " blue."},
        {"prompt": [{"role": "user", "content": "Sky colour?"}],
         "completion": [{"role": "assistant", "content": "Blue."}]},
    ])
    raw, conv = load_examples(p)
    assert (raw.prompt, raw.completion, raw.messages) == ("The sky is", " blue.", None)
    assert conv.messages == [{"role": "user", "content": "Sky colour?"},
                             {"role": "assistant", "content": "Blue."}]
    assert conv.train_from == 1 and conv.prompt is None


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
     "must both be strings or both lists of messages, found str and list"),
    ({"prompt": [{"role": "user", "content": "a"}],
      "completion": [{"role": "user", "content": "b"}]}, "completion has no assistant turn"),
    ({"prompt": "a"}, "needs a 'completion'"),
    ({"prompt": "a", "completion": 3}, "found str and int"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     r"messages\[1\].tool_calls\[0\].function.arguments is a string but not JSON"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     r"messages\[1\].tool_calls\[0\] must be"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "arguments must be an object"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "tools": {"name": "f"}}, "'tools' must be a list of objects"),
    ({"messages": [{"role": "tool", "content": "x", "name": 3}, {"role": "assistant", "content": "y"}]},
     r"messages\[0\].name must be a string"),
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "unknown role 'robot'"),
    ({"conversations": "hi"}, "'conversations' must be a non-empty list"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "b"}]},
     r"conversations\[0\].content must be a string"),
    ({"conversations": [], "messages": []}, "ambiguous row"),
])
def test_bad_rows_name_the_line(tmp_path, row, message):
    p = write(tmp_path, [{"text": "fine"}, row])
    with pytest.raises(DataError, match=message) as e:
        load_examples(p)
    assert str(e.value).startswith(f"{p}:2: ") and "\n" not in str(e.value)


def test_tool_calls_are_normalized(tmp_path):
    """OpenAI's shape (arguments a JSON string) and transformers' (a mapping) parse alike;
    a tool turn keeps its name and tool_call_id; tools reach the example."""
    call_text = {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    call_dict = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    rows = [{"messages": [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "name": "get_weather", "tool_call_id": "call_1",
                           "content": "22C", "extra": "dropped"},
                          {"role": "assistant", "content": "It is 22C."}],
             "tools": tools}
            for call, tools in ((call_text, [WEATHER]), (call_dict, json.dumps([WEATHER])))]
    a, b = load_examples(write(tmp_path, rows))
    expected_call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert a.messages[1] == {"role": "assistant", "content": "", "tool_calls": [{**expected_call, "id": "call_1"}]}
    assert b.messages[1] == {"role": "assistant", "content": "", "tool_calls": [expected_call]}
    assert a.messages[2] == {"role": "tool", "content": "22C", "name": "get_weather", "tool_call_id": "call_1"}
    assert a.tools == b.tools == [WEATHER]


def test_sharegpt_tool_turns_and_tools(tmp_path):
    p = write(tmp_path, [{"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                   "arguments": {"city": "Paris"}}}]},
        {"from": "tool", "value": "22C"}, {"from": "gpt", "value": "22C."}], "tools": [WEATHER]}])
    [ex] = load_examples(p)
    assert [m["role"] for m in ex.messages] == ["user", "assistant", "tool", "assistant"]
    assert ex.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert ex.tools == [WEATHER]


def test_llama_factory_tool_turns(tmp_path):
    """LLaMA-Factory's ShareGPT tool format: a function_call turn (its value the call's JSON)
    and an observation turn; "tools" a JSON string."""
    p = write(tmp_path, [{"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                        "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "22C"}, {"from": "gpt", "value": "22C."}],
        "tools": json.dumps([WEATHER])}])
    [ex] = load_examples(p)
    assert ex.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert ex.messages[2] == {"role": "tool", "content": "22C"} and ex.tools == [WEATHER]


def test_sharegpt_turn_weights_are_refused(tmp_path):
    p = write(tmp_path, [{"conversations": [{"from": "human", "value": "a"},
                                            {"from": "gpt", "value": "b", "weight": 0}]}])
    with pytest.raises(DataError, match=r"d.jsonl:1: conversations\[1\] has weight 0; per-turn "
                                        r"weights are not supported"):
        load_examples(p)
    ok = write(tmp_path, [{"conversations": [{"from": "human", "value": "a"},
                                             {"from": "gpt", "value": "b", "weight": 1}]}], "ok.jsonl")
    assert load_examples(ok)[0].messages[1] == {"role": "assistant", "content": "b"}
