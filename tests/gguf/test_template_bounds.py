"""A chat template is code from the internet (toygraph/gguf/tokenizer.py render_bounded):
hostile ones end in one line within seconds, naming the file and the template's line."""
from __future__ import annotations

import time

import pytest

import toygraph.gguf.tokenizer as tokenizer_module
from toygraph.errors import DataError
from toygraph.gguf.tokenizer import Tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def tok(tiny_llama):
    return Tokenizer.from_gguf(tiny_llama)


@pytest.mark.parametrize("template, needle", [
    ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),             # syntax
    ("{{ messages[0].nope.deeper }}", "UndefinedError"),                             # undefined
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),                                 # escape
    ("{{ 'x' * 100000000000 }}", "SecurityError"),                                   # memory bomb
    ("{{ 10 ** 100000000 }}", "SecurityError"),                                      # overflow
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),    # recursion
    ("{% include 'other.jinja' %}", "no loader"),                                    # include
    ("{{ raise_exception('no system role') }}", "no system role"),                   # its own
])
def test_a_hostile_or_broken_template_is_one_line(tok, template, needle):
    tok.use_template("hostile", template)
    with pytest.raises(DataError) as e:
        tok.apply_chat_template(HI)
    message = str(e.value)
    assert needle in message and "\n" not in message, message
    assert message.startswith(f"{tok.source}: the chat template (hostile)")


def test_a_templates_own_error_text_reaches_the_terminal_escaped(tok, tiny_llama, capsys):
    """raise_exception's text is the file's: an escape sequence in it cleared the screen or
    printed a fake green "All good"."""
    from toygraph.cli import main
    tok.use_template("hostile\x1b[2J", "{{ raise_exception('\x1b[2J\x1b[32mAll good\x07') }}")
    with pytest.raises(DataError) as e:
        tok.apply_chat_template(HI)
    message = str(e.value)
    assert "\x1b" not in message and "\x07" not in message, message
    assert "(hostile\\x1b[2J)" in message and "\\x1b[2J\\x1b[32mAll good\\x07" in message
    template = tiny_llama.parent / "hostile.jinja"
    template.write_text("{{ raise_exception('\x1b[2J\x1b]0;pwned\x07') }}")
    assert main(["generate", "--model", str(tiny_llama), "--prompt", "hi", "--chat",
                 "--template", str(template), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\x07" not in err, err


def test_a_template_error_names_its_line(tok):
    tok.use_template("lined", "line one\n{{ messages[0].a.b }}\n")
    with pytest.raises(DataError, match=r"\(lined\) line 2: UndefinedError"):
        tok.apply_chat_template(HI)


def test_a_template_that_never_ends_is_stopped(tok, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.5)
    tok.use_template("loop", "{% for i in range(100000) %}{% for j in range(100000) %}"
                             "{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"ran for more than 0.5s"):
        tok.apply_chat_template(HI)
    assert time.monotonic() - t0 < 5


def test_a_template_that_writes_without_end_is_stopped(tok, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "MAX_RENDER_CHARS", 10_000)
    tok.use_template("writer", "{% for i in range(100000) %}xxxxxxxxxx{% endfor %}")
    with pytest.raises(DataError, match="wrote more than 10,000 characters"):
        tok.apply_chat_template(HI)


def test_an_oversized_template_is_refused_before_compiling(tok, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "MAX_TEMPLATE_CHARS", 1000)
    tok.use_template("big", "x" * 2000)
    with pytest.raises(DataError, match="is 2,000 characters; templates over 1,000 are refused"):
        tok.apply_chat_template(HI)


def test_ordinary_templates_render_as_before(tok):
    assert tok.apply_chat_template(HI, add_generation_prompt=True).endswith("assistant\n")


@pytest.mark.parametrize("change, needle", [
    # a merge naming a token the vocabulary lacks ("~~" and "~" are not tokens here)
    (lambda merge: b"~~ " + b"~" * (len(merge) - 3), "cannot build a BPE tokenizer"),
    (lambda merge: b"~" * len(merge), "cannot build a BPE tokenizer"),        # no pair at all
    (lambda merge: b"\xff" + merge[1:], "'tokenizer.ggml.merges': string #0 of the array is not valid UTF-8"),
])
def test_a_broken_merges_list_is_one_line_naming_the_file(tiny_llama, tmp_path, change, needle):
    """A merge naming a token the vocabulary lacks, or merges that are not UTF-8 text, fail
    the tokenizer's load in one GGUFError naming the file (were tracebacks)."""
    import gguf

    from toygraph.errors import GGUFError
    reader = gguf.GGUFReader(tiny_llama)
    merges = reader.get_field("tokenizer.ggml.merges")
    first = bytes(merges.parts[merges.data[0]])
    data = tiny_llama.read_bytes()
    at = data.index(first, merges.offset)
    bad = tmp_path / "bad-merges.gguf"
    bad.write_bytes(data[:at] + change(first) + data[at + len(first):])
    with pytest.raises(GGUFError) as e:
        Tokenizer.from_gguf(bad)
    assert str(e.value).startswith(f"{bad}: ") and needle in str(e.value), str(e.value)


def test_generation_with_no_stop_token_says_so(tiny_llama, monkeypatch, caplog):
    """A GGUF naming no end-of-sequence/turn token would generate to the limit silently."""
    from toygraph.inference.language_model import LanguageModel
    monkeypatch.setattr(Tokenizer, "end_of_turn_ids", property(lambda self: frozenset()))
    with caplog.at_level("WARNING", logger="toygraph"):
        LanguageModel(tiny_llama)
    assert "names no end-of-sequence or end-of-turn token" in caplog.text


FRAGMENTS = [
    "{{ messages[0]['content'] }}", "{{ messages[0].content | upper }}", "{{ m }}",
    "{% for m in messages %}", "{% endfor %}", "{% if messages %}", "{% endif %}",
    "{{ 'ab' * 7 }}", "{{ 'ab' * 10**9 }}", "{{ 3 ** 99999 }}", "{{ x.y.z }}",
    "{{ ''.__class__ }}", "{{ [].__class__.__base__ }}", "{{ range(10**6) | list | length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}", "{{ f(1) }}", "{{ raise_exception('x') }}",
    "{% set ns = namespace(a=1) %}", "{% set ns.a = ns.a + 1 %}", "{{ ns.a }}",
    "{{ messages | tojson }}", "{% include 'x' %}", "{% import 'y' as z %}", "{{ 1 / 0 }}",
    "{{ bos_token }}", "{{ eos_token ~ eos_token }}", "{{ strftime_now('%Y') }}", "{%", "}}",
    "{{ messages[5] }}", "{{ dict(a=1).items() | list }}", "{{ '%s' % messages }}", "plain ",
]


def _fuzz(tok, count: int, seed: int) -> int:
    """Random templates from hostile and ordinary fragments: each renders to text or fails
    in one DataError line, within the time bound."""
    import random
    rng, errors = random.Random(seed), 0
    for _ in range(count):
        tok.use_template("fuzz", "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 6))))
        try:
            out = tok.apply_chat_template(HI, add_generation_prompt=True)
            assert isinstance(out, str)
        except DataError as e:
            assert "\n" not in str(e) and str(e).startswith(f"{tok.source}: "), str(e)
            errors += 1
    return errors


def test_template_fuzz(tok, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.2)
    errors = _fuzz(tok, 150, seed=7)
    assert 0 < errors < 150   # both kinds of outcome were exercised


@pytest.mark.slow
def test_template_fuzz_long(tok, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.2)
    _fuzz(tok, 3000, seed=11)
