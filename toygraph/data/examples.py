"""Reading JSONL data files into ``Example`` rows, with errors that name ``file:line``.

Accepted JSONL shapes (one object per line, blank lines skipped; extra keys are ignored):
instruction ``{"instruction", "response", "system"?}``, alpaca
``{"instruction", "input"?, "output", "system"?}``, chat ``{"messages": [{"role", "content"}]}``
and plain ``{"text"}``. Instruction/alpaca rows become chat messages. Hostile files are
bounded: a line longer than ``MAX_LINE_BYTES`` or nested deeper than ``MAX_JSON_DEPTH`` is
refused before it is parsed, and text that is not valid Unicode is refused with its line.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from toygraph.errors import DataError

ROLES = ("system", "user", "assistant")
SHAPES = ('{"instruction", "response", "system"?}', '{"instruction", "input"?, "output", "system"?}',
          '{"messages": [{"role", "content"}, ...]}', '{"text"}')


@dataclass
class Example:
    """One parsed row: chat ``messages`` (instruction data normalized) or plain ``text``."""
    messages: list[dict] | None = None
    text: str | None = None
    line: int = 0
    path: str | None = None  # for error messages raised while encoding

    @property
    def where(self) -> str:
        return f"{self.path or '<data>'}:{self.line}"


#: The longest line accepted (bytes). A training example is cut to --seq-len tokens anyway;
#: a longer line is almost surely a broken file (e.g. a whole dump on one line) and would
#: cost many times its size in memory while parsed and tokenized.
MAX_LINE_BYTES = 8 << 20
#: The deepest JSON nesting accepted; real rows are 3-4 levels deep.
MAX_JSON_DEPTH = 64


def load_examples(path, parse_row=None) -> list:
    """Parse a JSONL data file; raises DataError naming ``file:line`` on any bad row.
    ``parse_row(obj, where, line, path)`` turns one JSON value into a row (default: an
    ``Example``; toygraph.data.preference parses preference pairs through the same reader)."""
    p = Path(path)
    examples = []
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
    depth = _nesting(s)
    if depth > MAX_JSON_DEPTH:
        raise DataError(f"{where}: JSON nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} at column {e.colno}") from None
    return parse_row(obj, where, n, str(p))


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _nesting(s: str) -> int:
    """The bracket nesting depth of a JSON text (brackets inside strings do not count);
    json.loads recurses once a level, so it is checked before parsing."""
    if s.count("[") + s.count("{") <= MAX_JSON_DEPTH:
        return 0
    bare = _JSON_STRING.sub("", s)
    return max(accumulate(1 if c in "[{" else -1 for c in bare if c in "[]{}"), default=0)


def _parse_row(obj, where: str, line: int, path: str) -> Example:
    accepted = "accepted shapes: " + "; ".join(SHAPES)
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}; {accepted}")
    shapes = [k for k in ("messages", "instruction", "text") if k in obj]
    if len(shapes) != 1:
        found = _keys(obj) or "none"
        what = "ambiguous row" if shapes else "unknown row shape"
        raise DataError(f"{where}: {what} (keys found: {found}); {accepted}")
    if shapes[0] == "text":
        return Example(text=_string(obj, "text", where), line=line, path=path)
    if shapes[0] == "messages":
        return Example(messages=_parse_messages(obj["messages"], where), line=line, path=path)

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
    messages += [{"role": "user", "content": user},
                 {"role": "assistant", "content": _string(obj, answer_keys[0], where)}]
    return Example(messages=messages, line=line, path=path)


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


def _parse_messages(messages, where: str, need_assistant: bool = True) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list, found {_type_name(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{i}] must be an object, found {_type_name(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise DataError(f"{where}: messages[{i}].role must be a string, found {_type_name(role)}")
        if role not in ROLES:
            raise DataError(f"{where}: messages[{i}] has unknown role {role!r} "
                            f"(accepted: {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise DataError(f"{where}: messages[{i}].content must be a string, "
                            f"found {_type_name(content)}")
        out.append({"role": role, "content": _checked_text(content, where, f"messages[{i}].content")})  # drop extra keys: templates see only these
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: chat has no assistant turn, so nothing to train on")
    return out
