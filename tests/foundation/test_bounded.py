"""toygraph/bounded.py: the bounded JSON/YAML readers every structured file goes through,
and the escaping of file text on its way to a terminal."""
from __future__ import annotations

import os
import time

import pytest

from toygraph.bounded import (MAX_DEPTH, excerpt, load_json, load_yaml, parse_json, parse_yaml,
                              printable, read_bytes, regular_file_error, utf8_error)
from toygraph.errors import DataError, ToygraphError

#: 9 levels of 9 aliases: 9^9 = 387M strings once expanded, in under 1 KB.
BILLION_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_a_billion_laughs_is_refused_at_once():
    assert len(BILLION_LAUGHS) < 1024
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="YAML aliases expand to more than 100,000 values") as e:
        parse_yaml(BILLION_LAUGHS, "run.yaml")
    assert time.perf_counter() - t0 < 2 and one_line(e).startswith("run.yaml: ")


def test_yaml_aliases_within_bounds_still_work_and_a_self_reference_is_refused():
    assert parse_yaml("a: &x [1, 2]\nb: *x\n", "f") == {"a": [1, 2], "b": [1, 2]}
    with pytest.raises(DataError, match=r"alias \*x refers to a node that holds it"):
        parse_yaml("a: &x [1, *x]\n", "f")
    with pytest.raises(DataError, match="could not determine a constructor"):
        parse_yaml("x: !!python/object/apply:os.system [ls]\n", "f")   # safe types only


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000])
def test_deep_json_is_refused_before_the_parser_recurses(text):
    with pytest.raises(DataError, match=f"JSON nested 5000 levels deep \\(at most {MAX_DEPTH}\\)"):
        parse_json(text, "x.json")
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "x.json") is not None
    assert parse_json('"' + "[" * 5000 + '"', "x.json") == "[" * 5000   # brackets in a string


def test_deep_yaml_is_refused_before_the_composer_recurses():
    with pytest.raises(DataError, match=f"nested more than {MAX_DEPTH} levels"):
        parse_yaml("a: " + "[" * 500 + "]" * 500, "run.yaml")
    with pytest.raises(DataError, match="nesting depth"):   # libyaml's own bound, 1000
        parse_yaml("a: " + "[" * 5000 + "]" * 5000, "run.yaml")
    with pytest.raises(DataError, match=f"nested more than {MAX_DEPTH} levels"):
        parse_yaml("".join("  " * i + f"k{i}:\n" for i in range(200)), "run.yaml")


@pytest.mark.parametrize("text,needle", [
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('[Infinity]', "Infinity is not a JSON number"),
    ('[1e400]', "the number '1e400' is too large for a float"),
    ("[" + "9" * 5000 + "]", "not valid JSON"),
    ('{"a": 1', "not valid JSON"),
])
def test_json_numbers_are_finite(text, needle):
    with pytest.raises(DataError, match=needle) as e:
        parse_json(text, "x.json")
    one_line(e)
    assert parse_json('{"a": NaN}', "x", allow_nan=True)["a"] != 0   # when a caller names it


def test_only_regular_files_are_read_and_never_opened_otherwise(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)   # no writer: opening it for reading would block forever
    t0 = time.perf_counter()
    for path, kind in ((fifo, "FIFO"), ("/dev/zero", "character device"), (tmp_path, "directory")):
        with pytest.raises(ToygraphError, match=f"not a regular file \\(a {kind}\\)"):
            load_json(path, error=ToygraphError)
        assert kind in regular_file_error(path)
    assert time.perf_counter() - t0 < 2
    with pytest.raises(DataError, match="cannot read it"):
        read_bytes(tmp_path / "missing.json")
    assert regular_file_error(tmp_path / "missing.json").startswith("cannot read it")


def test_size_is_bounded_before_parsing(tmp_path):
    big = tmp_path / "run.yaml"
    big.write_text("name: '" + "x" * (2 << 20) + "'\n")   # a 2 MiB string
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="larger than 1 MiB") as e:
        load_yaml(big)
    assert time.perf_counter() - t0 < 2 and one_line(e)
    (tmp_path / "bad.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(DataError, match=r"not UTF-8 text \(invalid start byte at byte 7\)"):
        load_json(tmp_path / "bad.json")


def test_printable_escapes_what_a_terminal_would_obey():
    assert printable("ok\x1b[32m All good\x1b[0m") == "ok\\x1b[32m All good\\x1b[0m"
    assert printable("a\rb\x07\x9b\u202e\x00") == "a\\rb\\x07\\x9b\\u202e\\x00"
    assert printable("line\nnext") == "line\\nnext"
    assert printable("line\nnext", keep_newlines=True) == "line\nnext"
    assert printable("naïve – 日本") == "naïve – 日本"   # text stays text


def test_excerpt_is_bounded_whatever_it_shows():
    a = ["lol"] * 9
    for _ in range(8):
        a = [a] * 9
    t0 = time.perf_counter()
    shown = [excerpt(v) for v in (a, "x" * 10**6, 10**5000, "\x1b[2J", {"k": [[[[1]]]]})]
    assert time.perf_counter() - t0 < 0.5
    assert all(len(s) <= 80 for s in shown), shown
    assert shown[2] == "an integer of about 5000 digits" and shown[3] == "'\\x1b[2J'"


def test_utf8_error_names_the_byte():
    assert utf8_error("fine") is None
    assert utf8_error("a\udcffb") == "byte 0xff at character 1"
    assert utf8_error("\ud800") == "lone surrogate \\ud800 at character 0"
