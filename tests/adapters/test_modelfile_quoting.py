"""What goes into a Modelfile is quoted or refused (issue 46 item 9): a line break in the
base model's file name must not write directives of its own. Checked against a port of
Ollama's own parser (parser/parser.go, ParseFile's state machine), the independent reader
of these files."""
import random

import pytest

from toygraph.adapters.modelfile import modelfile_text, path_value

COMMANDS = {"from", "license", "template", "system", "adapter", "draft", "renderer", "parser",
            "parameter", "message", "requires"}
NIL, NAME, VALUE, PARAMETER, MESSAGE, COMMENT = range(6)


def _unquote(s: str):
    if s.startswith('"""'):
        return (s[3:-3], True) if len(s) >= 6 and s.endswith('"""') else ("", False)
    if s.startswith('"'):
        return (s[1:-1], True) if len(s) >= 2 and s.endswith('"') else ("", False)
    return s, True


def _step(r: str, state: int):
    """parseRuneForState: (next state, the rune kept or "", error or None)."""
    space, newline = r in " \t", r in "\r\n"
    if state == NIL:
        return (COMMENT, "", None) if r == "#" else (NIL, "", None) if space or newline \
            else (NAME, r, None)
    if state == NAME:
        return (NAME, r, None) if r.isascii() and r.isalpha() else (VALUE, "", None) if space \
            else (NIL, "", "invalid command")
    if state == VALUE:
        return (NIL, r, None) if space or newline else (VALUE, r, None)
    if state == PARAMETER:
        return (PARAMETER, r, None) if (r.isascii() and r.isalnum()) or r == "_" else \
            (VALUE, "", None) if space else (NIL, "", "unexpected EOF")
    if state == MESSAGE:
        return (MESSAGE, r, None) if r.isascii() and r.isalpha() else (VALUE, "", None) if space \
            else (NIL, "", "unexpected EOF")
    return (NIL, "", None) if newline else (COMMENT, "", None)


def ollama_commands(text: str) -> list[tuple[str, str]]:
    """The (name, value) commands Ollama reads from a Modelfile ("model" for FROM); a
    ValueError where Ollama reports a parse error."""
    commands, buf, state, name, role = [], "", NIL, None, ""
    for ch in text:
        nxt, kept, err = _step(ch, state)
        if err:
            raise ValueError(err)
        if nxt != state:
            if state == NAME:
                if buf.lower() not in COMMANDS:
                    raise ValueError(f"invalid command {buf!r}")
                word = buf.lower()
                if word == "parameter":
                    nxt = PARAMETER
                else:
                    nxt = MESSAGE if word == "message" else nxt
                    name = "model" if word == "from" else word
            elif state == PARAMETER:
                name = buf
            elif state == MESSAGE:
                role = buf
            elif state == VALUE:
                value, ok = _unquote(buf.strip())
                if not ok or ch in " \t":
                    buf += kept
                    continue
                commands.append((name, f"{role}: {value}" if role else value))
                role = ""
            buf, state = "", nxt
        if kept and kept.isprintable():
            buf += kept
    if state == VALUE:
        value, ok = _unquote(buf.strip())
        if not ok:
            raise ValueError("unexpected EOF")
        commands.append((name, value))
    elif state not in (NIL, COMMENT):
        raise ValueError("unexpected EOF")
    return commands


def _values(commands, name):
    return [v for n, v in commands if n == name]


def _linked(tmp_path, tiny_llama, name):
    """A base GGUF under ``name`` (a link to the tiny model: the name is what matters)."""
    path = tmp_path / name
    path.symlink_to(tiny_llama)
    return path


def test_the_port_reads_an_ordinary_modelfile(tiny_llama):
    commands = ollama_commands(modelfile_text(tiny_llama))
    assert _values(commands, "model") == [str(tiny_llama.absolute())]
    assert _values(commands, "adapter") == ["./adapter.gguf"]
    assert sorted(_values(commands, "stop")) == ["<|endoftext|>", "<|im_end|>"]


def test_a_newline_in_the_base_name_injects_nothing(tmp_path, tiny_llama):
    base = _linked(tmp_path, tiny_llama, "evil\nADAPTER stolen.gguf\nFROM other.gguf")
    text = modelfile_text(base)
    commands = ollama_commands(text)
    assert _values(commands, "adapter") == ["./adapter.gguf"]
    assert _values(commands, "model") == []   # refused: `ollama create` says "no FROM line"
    assert "No FROM: the base's path" in text and "\\nADAPTER" in text


def test_a_base_name_with_spaces_reads_back_whole(tmp_path, tiny_llama):
    base = _linked(tmp_path, tiny_llama, "my model  v2.gguf")
    assert _values(ollama_commands(modelfile_text(base)), "model") == [str(base.absolute())]


def test_a_template_name_with_a_newline_stays_in_its_comment(tiny_llama):
    """A Jinja --template file's name is shown in a comment; a line break in it would
    end the comment and start a directive."""
    template = ("/tmp/t\nADAPTER /etc/shadow\n.jinja", "{{ messages[0]['content'] }}")
    commands = ollama_commands(modelfile_text(tiny_llama, template=template))
    assert _values(commands, "adapter") == ["./adapter.gguf"]
    assert _values(commands, "model") == [str(tiny_llama.absolute())]


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_base_names_each_read_back_exactly_or_are_left_out(tmp_path, tiny_llama, seed):
    """Random names from the characters Ollama's parser treats specially: the FROM that
    Ollama reads is the path itself, or there is none; never another command."""
    rng = random.Random(seed)
    alphabet = ['"', "\n", "\r", "\t", " ", "#", "\x1b", "\u202e", "\\", "'", "a", "F", "é",
                '"""', "\nFROM x", "\nPARAMETER stop y"]
    for i in range(12):
        name = f"{i}" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) + ".gguf"
        base = _linked(tmp_path, tiny_llama, name)
        commands = ollama_commands(modelfile_text(base))
        assert _values(commands, "model") in ([str(base.absolute())], []), repr(name)
        assert _values(commands, "adapter") == ["./adapter.gguf"], repr(name)
        assert {n for n, _ in commands} <= {"model", "adapter", "template", "stop"}, repr(name)
        assert (path_value(str(base.absolute())) is None) == (_values(commands, "model") == [])
