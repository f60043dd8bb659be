"""Reading the small JSON and YAML files toygraph is handed, with every cost bounded, and
text from files made safe to print.

Every structured file a command reads goes through here: Ollama manifests and params
layers, ``adapter_config.json``, checkpoint manifests and state, run files (``--config``),
``json-schema:`` reward files, run logs. A hostile file meets a limit before it costs
anything:

- only a regular file is read (a FIFO or a device such as ``/dev/zero`` would block or
  never end): it is opened without blocking and checked before a byte is read;
- at most ``max_bytes`` of it;
- JSON and YAML nested at most ``MAX_DEPTH`` levels (Python's parsers recurse once a
  level, and a RecursionError is a traceback), checked before parsing;
- YAML's aliases expand to at most ``MAX_YAML_NODES`` nodes (a 1 KB "billion laughs" file
  is refused at once, not after minutes and GBs), and none may refer to itself;
- JSON numbers finite (no NaN or Infinity, no ``1e400`` read as inf) unless asked.

Errors are one line, a :class:`~toygraph.errors.DataError` (or the ``error`` class a
caller gives) naming the file, with :func:`excerpt` showing a bounded, escaped piece of
what was found. :func:`printable` escapes control characters in any text read from a file
before it reaches a terminal (a chat template's ``raise_exception`` text, a template name,
an error message): ``\\x1b[2J`` shows as those characters instead of clearing the screen.

>>> load_json("runs/x/checkpoints/step-4/manifest.json")          # doctest: +SKIP
>>> printable("ok\\x1b[32m All good")
'ok\\\\x1b[32m All good'
"""
from __future__ import annotations

import json
import os
import re
import reprlib
from itertools import accumulate
from pathlib import Path

from toygraph.errors import DataError
from toygraph.files import not_regular

#: Nesting any file toygraph reads needs is a handful of levels; 64 is far above it and
#: far below Python's recursion limit.
MAX_DEPTH = 64
#: Default size bound: every file read here is kilobytes (a checkpoint's state, a run file).
MAX_BYTES = 16 << 20
#: Nodes a YAML document may hold once its aliases are expanded (a run file has ~100).
MAX_YAML_NODES = 100_000
#: Characters of a found value an error message shows.
EXCERPT_CHARS = 80

# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, EXCERPT_CHARS, EXCERPT_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def printable(text, keep_newlines: bool = False) -> str:
    """``text`` with every control character written as an escape (``\\x1b``, ``\\n``,
    ``\\u202e``), as ``repr`` writes them; ``keep_newlines`` leaves line breaks alone."""
    def escape(m):
        c = m.group(0)
        if keep_newlines and c == "\n":
            return c
        return repr(c)[1:-1] if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return _CONTROL.sub(escape, str(text))


def terminal_text(text) -> str:
    """Text a model or a file produced, safe to show: every control character (an OSC 52
    clipboard write, a title change, a cursor move, the bidirectional overrides) escaped
    as :func:`printable` writes it, except the line breaks and tabs that lay text out. The
    one function for every place that prints a token, a file name, a path or a setting."""
    return _CONTROL.sub(lambda m: m.group(0) if m.group(0) in "\n\t" else printable(m.group(0)),
                        str(text))


def utf8_error(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (None when it is): undecodable bytes arrive as
    lone surrogates (Python's surrogateescape, for argv and a stdin so opened), which no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate \\u{c:04x}"
        return f"{what} at character {e.start}"
    return None


def excerpt(value, chars: int = EXCERPT_CHARS) -> str:
    """A bounded, escaped repr of ``value`` for an error message: at most a few items of a
    list or dict and a few levels deep (``reprlib``), cut at ``chars`` characters. Only
    what is shown is formatted, so a huge or deeply shared value costs nothing to describe."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    shown = printable(_REPR.repr(value))
    return shown if len(shown) <= chars else shown[:chars - 3] + "..."


def read_bytes(path, what: str | None = None, max_bytes: int = MAX_BYTES,
               error=DataError) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``; ``what`` names it in
    errors (default: the path). A FIFO, device, socket or directory is refused before
    anything is read from it, and so is a file over the bound."""
    what = what or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise error(f"{what}: cannot read it ({e.strerror or e})") from None
    kind = not_regular(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise error(f"{what}: not a regular file ({kind}); give a file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{what}: larger than {size_words(max_bytes)}, more than a file of this "
                    "kind ever holds")
    return data


def regular_file_error(path) -> str | None:
    """Why ``path`` cannot be read as a file without opening it (None when it can): it is
    missing, or a FIFO, device, socket or directory, which would block or never end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    kind = not_regular(mode)
    return None if kind is None else f"not a regular file ({kind}); give a file"


def size_words(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} bytes"


def read_text(path, what: str | None = None, max_bytes: int = MAX_BYTES, error=DataError) -> str:
    """:func:`read_bytes` decoded as UTF-8 (an error names the byte where it is not)."""
    data = read_bytes(path, what, max_bytes, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what or path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# --- JSON ---------------------------------------------------------------------------------------

def json_depth(text: str) -> int:
    """The bracket nesting depth of a JSON text (brackets inside strings do not count);
    0 when it cannot exceed MAX_DEPTH (fewer brackets than that: no scan needed)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0
    bare = _JSON_STRING.sub("", text)
    return max(accumulate(1 if c in "[{" else -1 for c in bare if c in "[]{}"), default=0)


def parse_json(text: str, what: str, allow_nan: bool = False, error=DataError):
    """The value of the JSON ``text`` (``what`` names it in errors): nesting bounded before
    parsing; NaN, Infinity and numbers that overflow to inf refused unless ``allow_nan``."""
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise error(f"{what}: JSON nested {depth} levels deep (at most {MAX_DEPTH})")

    def constant(name):
        raise error(f"{what}: {name} is not a JSON number")

    def number(s):
        value = float(s)
        if value in (float("inf"), float("-inf")):
            raise error(f"{what}: the number {excerpt(s)} is too large for a float")
        return value

    try:
        if allow_nan:
            return json.loads(text)
        return json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as e:
        raise error(f"{what}: not valid JSON ({e.msg}: line {e.lineno} column "
                    f"{e.colno})") from None
    except (ValueError, RecursionError) as e:   # e.g. an integer of 5,000 digits
        raise error(f"{what}: not valid JSON ({printable(str(e))[:200]})") from None


def load_json(path, what: str | None = None, max_bytes: int = MAX_BYTES,
              allow_nan: bool = False, error=DataError):
    """The JSON value in the regular file ``path`` (:func:`read_text`, :func:`parse_json`)."""
    what = what or str(path)
    return parse_json(read_text(path, what, max_bytes, error), what, allow_nan, error)


# --- YAML ---------------------------------------------------------------------------------------

def parse_yaml(text: str, what: str, max_nodes: int = MAX_YAML_NODES, error=DataError):
    """The value of the YAML ``text`` (safe types only), after one pass over its events
    that bounds its nesting and the nodes its aliases expand to, and refuses an alias to
    a node that holds it."""
    import yaml
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        _check_yaml_events(yaml.parse(text, Loader=loader), what, max_nodes, error)
        return yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = printable(getattr(e, "problem", None) or type(e).__name__)[:200]
        raise error(f"{what}: not valid YAML{at} ({problem})") from None


def _check_yaml_events(events, what: str, max_nodes: int, error) -> None:
    import yaml
    sizes: dict[str, int] = {}      # anchor -> nodes it expands to
    open_: list[list] = []          # [anchor, nodes so far] of each collection not yet closed
    total = 0
    for event in events:
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_.append([event.anchor, 1])
            if len(open_) > MAX_DEPTH:
                raise error(f"{what}: YAML nested more than {MAX_DEPTH} levels deep")
            n = 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, n = open_.pop()
            if anchor is not None:
                sizes[anchor] = n
            if open_:
                open_[-1][1] += n
            continue
        elif isinstance(event, yaml.ScalarEvent):
            n = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                raise error(f"{what}: YAML alias *{printable(event.anchor)[:40]} refers to a "
                            "node that holds it (or to no anchor)")
            n = sizes[event.anchor]
        else:
            continue
        if open_ and not isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_[-1][1] += n
        total += n
        if total > max_nodes:
            raise error(f"{what}: YAML aliases expand to more than {max_nodes:,} values "
                        "(an alias bomb?); write the values out")


def load_yaml(path, what: str | None = None, max_bytes: int = 1 << 20,
              max_nodes: int = MAX_YAML_NODES, error=DataError):
    """The YAML value in the regular file ``path`` (:func:`read_text`, :func:`parse_yaml`)."""
    what = what or str(path)
    return parse_yaml(read_text(path, what, max_bytes, error), what, max_nodes, error)


def path_inside(path: Path, root: Path) -> bool:
    """Whether ``path``, links resolved, lies inside ``root`` (links resolved too)."""
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
    except (ValueError, OSError, RuntimeError):   # RuntimeError: a symlink loop
        return False
    return True
