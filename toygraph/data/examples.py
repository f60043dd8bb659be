"""Reading JSONL data files into ``Example`` rows, with errors that name ``file:line``.

Accepted JSONL shapes (one object per line, blank lines skipped; extra keys are ignored):

- instruction ``{"instruction", "response", "system"?}`` and alpaca
  ``{"instruction", "input"?, "output", "system"?}``: become chat messages;
- chat ``{"messages": [{"role", "content"}], "tools"?}``: roles system, user, assistant and
  tool; an assistant turn may carry ``tool_calls`` (``[{"type": "function", "function":
  {"name", "arguments"}}]``, arguments an object or a JSON string of one), a tool turn
  ``name`` and/or ``tool_call_id``; ``tools`` (JSON schemas) reaches the chat template as
  its ``tools`` variable, as transformers' ``apply_chat_template(tools=...)`` passes it;
- ShareGPT ``{"conversations": [{"from", "value"}], "system"?, "tools"?}`` (``from``:
  human/user, gpt/assistant, system, tool, and LLaMA-Factory's function_call (value: the
  call's JSON) and observation; ``role``/``content`` keys are accepted too);
- prompt/completion ``{"prompt", "completion"}`` as TRL's SFT takes it: two strings (raw
  text, no template; the loss is on the completion, which gets EOS) or two message lists
  (rendered together with the template; the loss is on the completion's assistant turns);
- plain ``{"text"}``.

Parquet, CSV and Arrow files hold the same rows as table rows, read through the optional
``datasets`` library (toygraph/data/tables.py).

Hostile files are bounded: a line longer than ``MAX_LINE_BYTES`` or nested deeper than
``MAX_JSON_DEPTH`` is refused before it is parsed, and text that is not valid Unicode is
refused with its line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from toygraph.bounded import MAX_DEPTH, json_depth, printable, regular_file_error
from toygraph.data.tables import is_table, load_table
from toygraph.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
SHAPES = ('{"instruction", "response", "system"?}', '{"instruction", "input"?, "output", "system"?}',
          '{"messages": [{"role", "content"}, ...], "tools"?}',
          '{"conversations": [{"from", "value"}, ...]} (ShareGPT)',
          '{"prompt", "completion"} (strings, or lists of messages)', '{"text"}')
#: ShareGPT's speaker names (``from``) and the roles they are. LLaMA-Factory's tool turns:
#: "function_call" (an assistant turn whose value is the JSON of its call, or of a list of
#: calls) and "observation" (the tool's result).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}


@dataclass
class Example:
    """One parsed row: chat ``messages`` (instruction, ShareGPT and conversational
    prompt/completion rows normalized to them), plain ``text``, or a raw ``prompt`` and
    ``completion``. ``tools`` is the row's tool list for the template; ``train_from``
    the index of the first message whose assistant turns are trained (a conversational
    completion's first message; 0: every assistant turn)."""
    messages: list[dict] | None = None
    text: str | None = None
    line: int = 0
    path: str | None = None  # for error messages raised while encoding
    tools: list[dict] | None = None
    train_from: int = 0
    prompt: str | None = None
    completion: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path or '<data>'}:{self.line}"


#: The longest line accepted (bytes). A training example is cut to --seq-len tokens anyway;
#: a longer line is almost surely a broken file (e.g. a whole dump on one line) and would
#: cost many times its size in memory while parsed and tokenized.
MAX_LINE_BYTES = 8 << 20
#: The deepest JSON nesting accepted; real rows are 3-4 levels deep.
MAX_JSON_DEPTH = MAX_DEPTH


def load_examples(path, parse_row=None) -> list:
    """Parse a JSONL data file; raises DataError naming ``file:line`` on any bad row.
    ``parse_row(obj, where, line, path)`` turns one JSON value into a row (default: an
    ``Example``; toygraph.data.preference parses preference pairs through the same reader)."""
    if is_table(path):   # .parquet/.csv/.arrow, through the datasets library (tables.py)
        return load_table(path, parse_row or _parse_row)
    p = Path(path)
    examples = []
    if p.exists() and not p.is_dir() and not p.is_file():   # a FIFO or a device: never opened
        raise DataError(f"{p}: {regular_file_error(p)}")
    try:
        with open(p, "rb") as f:
            for n, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise DataError(f"{p}:{n}: line longer than {MAX_LINE_BYTES >> 20} MiB; "
                                    f"split the example (training uses --seq-len tokens of it)")
                ex = _parse_line(line, p, n, parse_row or _parse_row)
                if ex is not None:
                    examples.append(ex)
    except FileNotFoundError:
        raise DataError(f"{p}: data file not found") from None
    except IsADirectoryError:
        raise DataError(f"{p}: is a directory, not a data file") from None
    except OSError as e:
        raise DataError(f"{p}: cannot read data file: {e}") from e
    if not examples:
        raise DataError(f"{p}: no examples (the file is empty or holds only blank lines)")
    return examples


def _parse_line(line: bytes, p: Path, n: int, parse_row) -> Example | None:
    where = f"{p}:{n}"
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if n == 1:
        s = s.lstrip("\ufeff")  # editors on Windows like to add a BOM
    if not s.strip():
        return None
    depth = json_depth(s)
    if depth > MAX_JSON_DEPTH:
        raise DataError(f"{where}: JSON nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    s = s.rstrip("\r\n")   # else an unclosed object is reported at "line 2 column 1"
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} at column {e.colno}: "
                        f"{json_excerpt(s, e.pos)}") from None
    return parse_row(obj, where, n, str(p))


def json_excerpt(line: str, pos: int, width: int = 30) -> str:
    """The text of ``line`` around character ``pos`` (at most ``width`` either side,
    escaped), with ``<here>`` where the JSON parser stopped."""
    head = ("..." if pos > width else "") + line[max(0, pos - width):pos]
    tail = line[pos:pos + width] + ("..." if len(line) > pos + width else "")
    return printable(f"{head}<here>{tail}")


def _parse_row(obj, where: str, line: int, path: str) -> Example:
    accepted = "accepted shapes: " + "; ".join(SHAPES)
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}; {accepted}")
    shapes = [k for k in ("messages", "conversations", "prompt", "instruction", "text") if k in obj]
    if len(shapes) != 1:
        found = _keys(obj) or "none"
        what = "ambiguous row" if shapes else "unknown row shape"
        raise DataError(f"{where}: {what} (keys found: {found}); {accepted}")
    shape, row = shapes[0], Example(line=line, path=path)
    if shape == "text":
        row.text = _string(obj, "text", where)
    elif shape == "messages":
        row.messages, row.tools = _parse_messages(obj["messages"], where), _tools(obj, where)
    elif shape == "conversations":
        row.messages, row.tools = _sharegpt(obj, where), _tools(obj, where)
    elif shape == "prompt":
        _prompt_completion(obj, where, row)
    else:
        row.messages = _instruction(obj, where, accepted)
    return row


def _instruction(obj: dict, where: str, accepted: str) -> list[dict]:
    answer_keys = [k for k in ("response", "output") if k in obj]
    if len(answer_keys) != 1:
        found = _keys(obj)
        raise DataError(f"{where}: an instruction row needs exactly one of 'response' or 'output' "
                        f"(keys found: {found}); {accepted}")
    instruction = _string(obj, "instruction", where)
    extra = _string(obj, "input", where, optional=True)
    system = _string(obj, "system", where, optional=True)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": user},
                       {"role": "assistant", "content": _string(obj, answer_keys[0], where)}]


def _sharegpt(obj: dict, where: str) -> list[dict]:
    """ShareGPT turns as messages (TRL's ``maybe_convert_to_chatml``, with its speaker names
    mapped to roles); a top-level "system" string becomes the first message."""
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list, found {_type_name(turns)}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: conversations[{i}] must be an object, found {_type_name(turn)}")
        if "from" not in turn:   # already role/content: checked by _parse_messages
            messages.append(turn)
            continue
        speaker = turn["from"]
        if speaker not in SHAREGPT_ROLES:
            raise DataError(f"{where}: conversations[{i}] has unknown 'from' {speaker!r} "
                            f"(accepted: {', '.join(SHAREGPT_ROLES)})")
        if turn.get("weight", 1) != 1:   # FastChat/axolotl: weight 0 = not trained
            raise DataError(f"{where}: conversations[{i}] has weight {turn['weight']!r}; per-turn "
                            f"weights are not supported (use prompt/completion rows to train "
                            f"only some turns)")
        message = {k: v for k, v in turn.items() if k not in ("from", "value", "weight")}
        message.update(role=SHAREGPT_ROLES[speaker], content=turn.get("value"))
        if speaker == "function_call":
            value = turn.get("value")
            calls = (_json_value(value, where, f"conversations[{i}].value")
                     if isinstance(value, str) else value)
            message.update(content="", tool_calls=calls if isinstance(calls, list) else [calls])
        messages.append(message)
    system = _string(obj, "system", where, optional=True)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return _parse_messages(messages, where, what="conversations")


def _prompt_completion(obj: dict, where: str, row: Example) -> None:
    """TRL's prompt-completion row: two strings (raw text) or two lists of messages
    (conversational: the completion's assistant turns are trained)."""
    if "completion" not in obj:
        raise DataError(f"{where}: a prompt row needs a 'completion' (keys found: {_keys(obj)}); "
                        f"for grpo's prompt-only rows use --recipe grpo")
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        row.prompt = _string(obj, "prompt", where)
        row.completion = _string(obj, "completion", where)
        return
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists "
                        f"of messages, found {_type_name(prompt)} and {_type_name(completion)}")
    head = _parse_messages(prompt, where, need_assistant=False, what="prompt")
    tail = _parse_messages(completion, where, need_assistant=False, what="completion")
    if not any(m["role"] == "assistant" for m in tail):
        raise DataError(f"{where}: the completion has no assistant turn, so nothing to train on")
    row.messages, row.train_from, row.tools = head + tail, len(head), _tools(obj, where)


def _tools(obj: dict, where: str) -> list[dict] | None:
    """A row's "tools": a list of objects (JSON schemas), or a JSON string of one (as TRL
    reads a "tools" column); None when absent."""
    tools = obj.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        tools = _json_value(tools, where, "'tools'")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: 'tools' must be a list of objects (JSON schemas), "
                        f"found {_type_name(tools)}")
    return tools or None


def _json_value(text: str, where: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: {what} is a string but not JSON: {e.msg} at column "
                        f"{e.colno}") from None


def _string(obj: dict, key: str, where: str, optional: bool = False) -> str | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, found {_type_name(value)}")
    return _checked_text(value, where, f"'{key}'")


def _checked_text(value: str, where: str, what: str) -> str:
    """JSON may escape a lone surrogate (\\ud800), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: {what} holds a lone surrogate (\\u{ord(value[e.start]):04x} "
                        f"at character {e.start}), not valid Unicode text") from None
    return value


def _keys(obj: dict) -> str:
    """The row's keys for an error message, escaped so that the message stays one line."""
    return ", ".join(json.dumps(k)[1:-1] for k in sorted(obj))


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _parse_messages(messages, where: str, need_assistant: bool = True,
                    what: str = "messages") -> list[dict]:
    """Checked messages: role and content (a string; None or absent only on an assistant
    turn that calls tools), an assistant's ``tool_calls`` normalized, a tool turn's ``name``
    and ``tool_call_id``. Other keys are dropped: templates see only these."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{what}' must be a non-empty list, found {_type_name(messages)}")
    out = []
    for i, m in enumerate(messages):
        at = f"{what}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: {at} must be an object, found {_type_name(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise DataError(f"{where}: {at}.role must be a string, found {_type_name(role)}")
        if role not in ROLES:
            raise DataError(f"{where}: {at} has unknown role {role!r} "
                            f"(accepted: {', '.join(ROLES)})")
        message = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], where, at)
            content = "" if content is None else content
        if not isinstance(content, str):
            raise DataError(f"{where}: {at}.content must be a string, found {_type_name(content)}")
        message["content"] = _checked_text(content, where, f"{at}.content")
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise DataError(f"{where}: {at}.{key} must be a string, "
                                        f"found {_type_name(m[key])}")
                    message[key] = m[key]
        out.append(message)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: chat has no assistant turn, so nothing to train on")
    return out


def _tool_calls(calls, where: str, at: str) -> list[dict]:
    """An assistant's tool calls as transformers' templates read them: ``{"type":
    "function", "function": {"name", "arguments"}}`` (an "id" kept), arguments an object (a
    JSON string of one is parsed: templates write it with ``tojson``)."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where}: {at}.tool_calls must be a non-empty list, found {_type_name(calls)}")
    out = []
    for j, call in enumerate(calls):
        here = f"{at}.tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"{where}: {here} must be {{\"type\": \"function\", \"function\": "
                            f"{{\"name\", \"arguments\"}}}}, found {_type_name(call)}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = _json_value(args, where, f"{here}.function.arguments")
        if not isinstance(args, dict):
            raise DataError(f"{where}: {here}.function.arguments must be an object (or a JSON "
                            f"string of one), found {_type_name(args)}")
        normal = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            normal["id"] = call["id"]
        out.append(normal)
    return out
