"""Tools for GRPO rollouts (issue 50, item 1): the calls a completion makes, parsed from the
chat template's own format, and the sandboxed process that runs them.

>>> box = ToolBox("tools.py", timeout=5)                                  # doctest: +SKIP
>>> box.schemas[0]["function"]["name"]                                   # doctest: +SKIP
'add'
>>> [box.reply(c) for c in parse_tool_calls(completion, "qwen")]          # doctest: +SKIP
['5']

Formats (``STYLES``):

- ``qwen`` / ``hermes`` (Qwen2.5's template is Hermes'): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a last call whose closing
  tag is missing (sampling stopped on it) still counts.
- ``llama3``: Llama 3.1-3.3's JSON tool calls, the reply being one object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``; several separated by ``;``.
- ``json``: a turn that opens with ``{"name": ..., "arguments": {...}}`` -- bare, or in a
  Markdown ```` ```json ```` fence -- and ends there; several separated by ``;`` or
  newlines. Not a template's format but what small models write when shown one: asked
  with Qwen2.5's template and a tool, Qwen2.5-Coder-0.5B writes its calls this way and
  never in ``<tool_call>`` tags (bench/grpo_calculator.py). Chosen with
  ``--tool-call-style json``, never guessed; like Llama 3.x's, such a call ends its turn.

A call that cannot be run -- not JSON, no name, arguments that are not an object -- is a
``ToolCallError`` whose one-line text becomes the tool's reply, as TRL returns a tool's
error to the model; so are a tool that raises, exits, forks, overruns its time limit, or
is unknown. A reply longer than ``max_chars`` is cut, saying how much was left out.

GRPO's ``--tools`` runs its calls through these (recipes/episodes.py says what is
wired); the llama3 and json styles' calls end the turn, and GRPO's sampler stops there.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from toygraph.recipes.rewards import RewardError, RewardWorker

STYLES = ("qwen", "hermes", "llama3", "json")
#: The styles whose calls end the turn (sampling stops on an end-of-turn token).
TURN_STYLES = ("llama3", "json")
#: Seconds one tool call may take.
TOOL_TIMEOUT = 10.0
#: Characters of a tool's reply the model gets back.
MAX_REPLY_CHARS = 2000
#: Characters of an error's one line (an exception's message may be long).
ERROR_CHARS = 500

_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*?)(?:\n```|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolCallError:
    """A call that cannot be run; ``text`` (one line) is the reply the model gets."""
    text: str


def _unwrap_turn(text: str, style: str) -> str:
    """A turn-style completion with its wrapper taken off: Llama 3.x's ``<|python_tag|>``
    prefix, or the json style's Markdown fence."""
    if style == "llama3":
        return (text.split(_PYTHON_TAG, 1)[1] if _PYTHON_TAG in text else text).strip()
    body = text.strip()
    fenced = _FENCE.match(body)
    return fenced.group(1).strip() if fenced else body


def parse_tool_calls(text: str, style: str) -> list[ToolCall | ToolCallError]:
    """The tool calls in a completion's ``text`` written in ``style`` (STYLES), in order;
    an empty list when it makes none."""
    if style in ("qwen", "hermes"):
        bodies = [m.group(1) for m in _HERMES_CALL.finditer(text)]
        key = "arguments"
    elif style in TURN_STYLES:   # the turn opens with the call objects, or is no call
        body = _unwrap_turn(text, style)
        if not body.startswith("{"):   # a plain answer: no call
            return []
        bodies, key = _split_objects(body), "parameters" if style == "llama3" else "arguments"
    else:
        raise ValueError(f"tool-call style {style!r}: choose one of {', '.join(STYLES)}")
    return [_call(body, key, i + 1) for i, body in enumerate(bodies)]


def _split_objects(body: str) -> list[str]:
    """``{...}; {...}`` as its objects' texts (one text when it is not such a list)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return out + [body[at:]]   # the rest, to be reported as not JSON
        out.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return out


def _call(body: str, key: str, n: int) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"error: tool call {n} is not JSON ({e.msg} at character {e.pos}); "
                             f'write {{"name": ..., "{key}": {{...}}}}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError(f"error: tool call {n} names no tool; write "
                             f'{{"name": ..., "{key}": {{...}}}}')
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCallError(f"error: tool call {n} ({obj['name']}): its {key} are not a JSON "
                             f"object")
    return ToolCall(obj["name"], args)


class ToolBox:
    """The tools a Python file defines, run in a process of their own
    (recipes/reward_worker.py), each call bounded by ``timeout`` seconds. ``schemas`` are
    their JSON schemas, for the chat template's ``tools``. ``reply(call)`` is always a
    one-line-or-more text for the model, never an exception: after a call that leaves the
    process in an unknown state (a time-out, an exit, a crash) a fresh one is started for
    the next."""

    def __init__(self, path: str, timeout: float = TOOL_TIMEOUT,
                 max_chars: int = MAX_REPLY_CHARS):
        self.path, self.timeout, self.max_chars = str(path), float(timeout), max_chars
        self._worker = self._start()

    def _start(self) -> "_ToolWorker":
        worker = _ToolWorker(self.path, self.timeout)
        self.schemas = worker.schemas
        self.names = [s["function"]["name"] for s in self.schemas]
        return worker

    def reply(self, call: ToolCall | ToolCallError) -> str:
        """What the model reads back for ``call``: the tool's value as text (a string as
        it is, anything else as JSON where it can be), or a one-line error."""
        if isinstance(call, ToolCallError):
            return call.text
        if call.name not in self.names:
            return _cut(f"error: no tool named {call.name!r} (tools: {', '.join(self.names)})",
                        ERROR_CHARS)
        if not self._worker.alive:
            self._worker = self._start()
        try:
            value = self._worker.call(self.names.index(call.name), call.arguments, call.name)
        except RewardError as e:   # the worker said what went wrong, or ran out of time
            return _cut("error: " + " ".join(str(e).split()), ERROR_CHARS)
        return _cut(value if isinstance(value, str) else _as_text(value), self.max_chars)

    def close(self) -> None:
        self._worker.close()


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def _as_text(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


class _ToolWorker(RewardWorker):
    """RewardWorker's process, time limit and one-line errors, loading a tools file."""
    timeout_flag, process = "the tools' time limit", "the process tools run in"

    def __init__(self, path: str, timeout: float):
        self.specs, self.timeout = [path], timeout
        self._start(f"--tools {path}: cannot start the process tools run in")
        answer = self._ask(("tools", path), f"--tools {path}")
        if answer[0] != "ok":
            self._stop()
            raise RewardError(f"--tools {path}: cannot load it ({answer[1]}: {answer[2]})")
        self.schemas = answer[1]

    @property
    def alive(self) -> bool:
        return self._stop.alive

    def call(self, index: int, arguments: dict, name: str):
        what = f"tool {name}"
        answer = self._ask(("tool", index, arguments), what)
        kind = answer[0]
        if kind == "ok":
            return answer[1]
        if kind == "raised":   # an exception: the worker is fine, the tool said no
            raise RewardError(f"{what} raised {answer[1]}: {answer[2]}")
        self._stop()
        if kind == "exit":
            raise RewardError(f"{what} called sys.exit({answer[1]!r})")
        if kind == "fork":
            raise RewardError(f"{what} called os.fork(); tools must not fork")
        raise RewardError(f"{what} returned a value that cannot be passed back: {answer[1]}")

    def close(self) -> None:
        self._stop()
