"""The command line: tokenize, eval, finetune, gate, and clear errors on bad input."""
import json
import os

import pytest

from toygraph.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tokenize_prints_json_ids(capsys, tiny_llama):
    code, out, _ = run(capsys, "tokenize", "--model", str(tiny_llama), "--text", "the cat")
    ids = json.loads(out)
    assert code == 0 and isinstance(ids, list) and all(isinstance(i, int) for i in ids)


def test_eval_tokens_text_and_json(capsys, tiny_llama):
    code, out, _ = run(capsys, "eval", "--model", str(tiny_llama), "--tokens", "5,9,14,3,7", "--json")
    res = json.loads(out)
    assert code == 0 and res["tokens"] == 4
    assert res["perplexity"] == pytest.approx(2.718281828 ** res["loss"], rel=1e-6)
    code, out, _ = run(capsys, "eval", "--model", str(tiny_llama), "--text", "the cat sat")
    assert code == 0 and "perplexity" in out


def test_finetune_then_eval_with_adapter(capsys, tiny_llama, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))
    out_dir = tmp_path / "run"
    code, out, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data", str(data),
                         "--out", str(out_dir), "--steps", "3", "--batch", "2", "--seq-len", "32",
                         "--rank", "2", "--targets", "q,k,v,o", "--val-split", "0", "--quiet")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["status"] == "completed"
    code, out, err = run(capsys, "eval", "--model", str(tiny_llama), "--data", str(data),
                         "--adapter", str(out_dir), "--json")
    assert code == 0, err and json.loads(out)["tokens"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["finetune", "--model", "nope.gguf", "--data", "x.jsonl", "--out", "o"], "no such file"),
    (["eval", "--model", "nope.gguf", "--tokens", "1,2"], "no such file"),
])
def test_missing_model_is_a_clear_error(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_tokenize_reads_the_gguf_through_the_bounded_reader(capsys, tiny_llama, tmp_path):
    """tokenize used gguf-py's own reader: a 4-byte file was an IndexError traceback."""
    four = tmp_path / "four.gguf"
    four.write_bytes(b"GGUF")
    code, _, err = run(capsys, "tokenize", "--model", str(four), "--text", "hi")
    assert code == 2 and err.count("\n") == 1 and "shorter than a GGUF header" in err, err
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_llama.read_bytes()[:200])   # counts that point past the end
    code, _, err = run(capsys, "tokenize", "--model", str(cut), "--text", "hi")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err


def test_finetune_bad_inputs(capsys, tiny_llama, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "response": "b"}\n{"foo": 1}\n')
    common = ["finetune", "--model", str(tiny_llama), "--out", str(tmp_path / "o"), "--quiet"]
    code, _, err = run(capsys, *common, "--data", str(bad))
    assert code == 2 and "bad.jsonl:2" in err
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello there"}\n' * 4)
    code, _, err = run(capsys, *common, "--data", str(good), "--seq-len", "100000")
    assert code == 2 and "context length" in err
    code, _, err = run(capsys, *common, "--data", str(good), "--targets", "q,attn")
    assert code == 2 and "LoRA targets" in err


def test_gate_checks_goldens(capsys):
    code, out, _ = run(capsys, "gate", "lora_qv_tiny_llama")
    assert code == 0 and out.startswith("PASS lora_qv_tiny_llama")
    code, _, err = run(capsys, "gate", "no_such_experiment")
    assert code == 2 and "unknown experiments" in err


def test_generate_greedy_is_deterministic(capsys, tiny_llama):
    argv = ["generate", "--model", str(tiny_llama), "--prompt", "the cat", "--max-new-tokens", "6"]
    code, out1, _ = run(capsys, *argv)
    code2, out2, _ = run(capsys, *argv, "--chat")
    code3, out3, _ = run(capsys, *argv)
    assert code == code2 == code3 == 0 and out1 == out3
    code, s1, _ = run(capsys, *argv, "--temperature", "1.0", "--top-k", "5", "--seed", "3")
    code, s2, _ = run(capsys, *argv, "--temperature", "1.0", "--top-k", "5", "--seed", "3")
    assert s1 == s2


def test_generate_system_message_goes_through_the_chat_template(capsys, tiny_llama):
    """--system puts a system turn before the prompt (and implies --chat): the text is what
    LanguageModel.generate gives for those two messages, from a prompt of their length."""
    from toygraph.inference.language_model import LanguageModel
    argv = ["generate", "--model", str(tiny_llama), "--prompt", "the cat", "--max-new-tokens", "6"]
    code, with_system, err = run(capsys, *argv, "--system", "Answer in one word.")
    assert code == 0, err
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "the cat"}]
    lm = LanguageModel(str(tiny_llama))
    assert with_system == lm.generate(messages, chat=True, max_new_tokens=6) + "\n"
    code, same, _ = run(capsys, *argv, "--system", "Answer in one word.", "--chat")
    assert code == 0 and same == with_system
    # the system turn reached the model: the prompt it reports is the two messages'
    n_prompt = len(lm.encode_prompt(messages, chat=True))
    assert f"after a {n_prompt}-token prompt" in err, err
    code, _, plain = run(capsys, *argv, "--chat")
    assert code == 0 and f"after a {n_prompt}-token prompt" not in plain


@pytest.mark.parametrize("flags, needle", [
    (["--batch", "0"], "--batch must be an integer >= 1, got 0"),
    (["--grad-accum", "0"], "--grad-accum must be an integer >= 1"),
    (["--seq-len", "0"], "--seq-len must be an integer >= 1"),
    (["--rank", "0"], "--rank must be an integer >= 1"),
    (["--rank", "40"], "--rank 40 exceeds the v matrix's smaller side 32"),
    (["--alpha", "0"], "--alpha must be a finite number > 0"),
    (["--alpha", "nan"], "--alpha must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--epochs", "inf"], "--epochs must be a finite number > 0"),
    (["--eval-every", "-1"], "--eval-every must be an integer >= 0"),
    (["--save-every", "-2"], "--save-every must be an integer >= 0"),
    (["--save-minutes", "-1"], "--save-minutes must be a finite number >= 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be an integer >= 1"),
    (["--patience", "-1"], "--patience must be an integer >= 0"),
    (["--patience", "2", "--val-split", "0"], "--patience needs a validation set"),
    (["--max-examples", "-3"], "--max-examples must be an integer >= 1"),
    (["--val-split", "1"], "--val-split must be a finite number >= 0 and < 1"),
    (["--diverge-factor", "0.5"], "--diverge-factor must be > 1"),
    (["--allow-change", "lr,colour"], "--allow-change: no options named ['colour']"),
    (["--resume", "x", "--overwrite"], "give --resume or --overwrite, not both"),
])
def test_finetune_arguments_are_checked_up_front(capsys, tiny_llama, tmp_path, flags, needle):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello there"}\n' * 4)
    out = tmp_path / "o"
    code, _, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data", str(data),
                       "--out", str(out), "--quiet", "--targets", "q,v", *flags)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("out_dir, needle", [("", "--out must name a directory"),
                                             ("FILE/run", "is a file, not a directory")])
def test_finetune_out_must_be_a_usable_directory(capsys, tiny_llama, tmp_path, out_dir, needle):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello there"}\n' * 4)
    (tmp_path / "FILE").write_text("not a directory")
    out = out_dir.replace("FILE", str(tmp_path / "FILE"))
    code, _, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data", str(data),
                       "--out", out, "--quiet")
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_finetune_exit_codes_say_how_the_run_ended(capsys, tiny_llama, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))
    common = ["finetune", "--model", str(tiny_llama), "--data", str(data), "--steps", "4",
              "--batch", "2", "--seq-len", "32", "--rank", "2", "--val-split", "0", "--quiet"]
    code, out, _ = run(capsys, *common, "--out", str(tmp_path / "ok"))
    assert code == 0 and json.loads(out)["status"] == "completed"
    code, out, err = run(capsys, *common, "--out", str(tmp_path / "bad"), "--lr", "1e10")
    assert code == 3 and json.loads(out)["status"] == "diverged" and "run diverged" in err


@pytest.mark.parametrize("flags, needle", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    (["--temperature", "nan"], "--temperature must be"),
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 text (byte 0xe9 at character 3)"),
])
def test_generate_arguments_are_checked(capsys, tiny_llama, flags, needle):
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama), "--prompt", "hi", *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_generate_stops_at_the_context(tmp_path):
    """--max-new-tokens far beyond a 24-token context ends at the context, not a hang."""
    from toygraph.fixtures.tiny_models import write_tiny_llama
    from toygraph.inference.language_model import LanguageModel
    lm = LanguageModel(str(write_tiny_llama(tmp_path / "short.gguf", n_ctx=24)))
    lm.stop_ids = set()  # never stop early: the context is the only limit left
    real_next_logits = lm.next_logits
    for kv_cache in (True, False):
        rows = []

        def counted(*args, **kwargs):  # one logits row (forward or decode) per new token
            for row in real_next_logits(*args, **kwargs):
                rows.append(1)
                yield row

        lm.next_logits = counted
        lm.generate("the cat", max_new_tokens=10**9, kv_cache=kv_cache)
        assert len(rows) == lm.seq_len - len(lm.encode_prompt("the cat", False)), kv_cache


def test_demo_next_steps_run_as_printed(capsys, tiny_llama, tmp_path, monkeypatch):
    """The commands the demo ends with work when pasted: chat and export run through the
    real CLI on a finished run, and the Modelfile the Ollama line names exists."""
    import io
    import shlex

    import gguf

    from toygraph.demo.capitals import next_steps
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))
    out_dir = tmp_path / "my run"  # a space: the printed commands must quote it
    code, _, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data", str(data),
                       "--out", str(out_dir), "--steps", "2", "--batch", "2", "--seq-len", "32",
                       "--rank", "2", "--targets", "q,v", "--val-split", "0", "--quiet")
    assert code == 0, err
    chat, export, ollama = (shlex.split(c) for c, _ in next_steps(str(out_dir), str(tiny_llama)))
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    assert chat[0] == "toygraph" and run(capsys, *chat[1:])[0] == 0
    code, _, err = run(capsys, *export[1:])
    assert export[0] == "toygraph" and code == 0, err
    merged = gguf.GGUFReader(export[export.index("--out") + 1])
    name = merged.get_field("general.name")
    assert "my run (merged)" in bytes(name.parts[name.data[0]]).decode()
    assert ollama[:3] == ["ollama", "create", "capitals"] and (out_dir / "Modelfile").is_file()
    assert ollama[4] == str(out_dir / "Modelfile")


def test_demo_questions_are_taught_by_the_shipped_data():
    """Every demo question asks about a country capitals.jsonl teaches, in a phrasing the
    data does not hold: the demo tests a learned fact, not a memorized line."""
    from toygraph.demo.capitals import QUESTIONS, data_path, parse, taught_answers
    rows = [json.loads(line) for line in data_path().read_text(encoding="utf-8").splitlines()]
    taught = taught_answers(data_path())
    for question, country in QUESTIONS:
        assert country in question and parse(taught[question])["country"] == country
        assert question not in {r["instruction"] for r in rows}
        assert {"instruction": question, "response": taught[question]} not in rows


def test_demo_refuses_data_that_does_not_teach_its_countries(tmp_path):
    from toygraph.demo.capitals import taught_answers
    from toygraph.errors import DataError
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"instruction": "Capital of Peru?",
                                "response": "country: Peru\ncapital: Lima"}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl: teaches no capital for Japan, Kenya, Norway"):
        taught_answers(data)


def test_demo_refuses_data_whose_replies_are_not_records(tmp_path):
    """A row in another form (the JSON the demo used to teach) is named by file and line,
    not skipped: every answer is checked against the reply its row teaches."""
    from toygraph.demo.capitals import replies_by_country
    from toygraph.errors import DataError
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"instruction": "Capital of Peru?",
                                "response": "country: Peru\ncapital: Lima"}) + "\n" +
                    json.dumps({"instruction": "Capital of Cape Verde?",
                                "response": '{"country": "Cape Verde", "capital": "Praia"}'}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl:2: the response is not a two-line record"):
        replies_by_country(data)


def test_demo_countries_are_in_the_training_part():
    """The demo's validation split (its seed and fraction) leaves every demo country at
    least one training row: a fact seen only in validation would not be taught."""
    from toygraph.data.batches import split_train_val
    from toygraph.demo.capitals import QUESTIONS, RECIPE, data_path, parse
    rows = [json.loads(line) for line in data_path().read_text(encoding="utf-8").splitlines()]
    train, _ = split_train_val(rows, RECIPE["val_split"], RECIPE["seed"])
    trained = {parse(r["response"])["country"] for r in train}
    assert {country for _, country in QUESTIONS} <= trained


def test_demo_verdict_wants_the_taught_record_exactly():
    from toygraph.demo.capitals import render, verdict
    taught = render("Kenya", "Nairobi")
    assert taught == "country: Kenya\ncapital: Nairobi"
    assert verdict(taught, taught) == verdict(f" {taught}\n", taught) == "right"
    assert verdict("country: Kenya\ncapital: Djiburia", taught) == \
        "wrong: the data says Nairobi, not Djiburia"
    assert verdict("country: Uganda\ncapital: Kampala", taught) == \
        "wrong: the record names Uganda, not Kenya"
    assert verdict("The capital of Kenya is Nairobi.", taught) == "wrong: not the two-line record"
    assert verdict("country:  Kenya\ncapital:Nairobi", taught) == \
        "wrong: the right fact, not in the taught two-line record"
    for other in ('{"country": "Kenya", "capital": "Nairobi"}', "capital: Nairobi\ncountry: Kenya",
                  "country: Kenya\ncapital: Nairobi\ncountry: Chad", "country: Kenya\ncapital:",
                  "country: Kenya"):
        assert verdict(other, taught) == "wrong: not the two-line record", other


def test_demo_loss_curve_averages_the_steps_before_each_point(tmp_path):
    from toygraph.demo.capitals import loss_curve
    events = tmp_path / "events.jsonl"
    lines = [{"event": "run_start"}] + [{"event": "step", "step": i, "loss": float(i)}
                                          for i in range(1, 41)]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    # points at steps 1, 10, 20, 30, 40; each the mean of up to 10 steps ending there
    assert loss_curve(events) == ["1.000@1", "5.500@10", "15.500@20", "25.500@30", "35.500@40"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TOYGRAPH_DEMO_TEST") != "1",
                    reason="the whole demo takes minutes: TOYGRAPH_DEMO_TEST=1 runs it")
def test_demo_answers_every_question_as_the_data_teaches(capsys, smollm2, tmp_path):
    """The whole demo, as `toygraph demo` runs it: after fine-tuning, every answer is the
    record capitals.jsonl teaches for that country, and the closing commands follow.
    Opt-in (it would take a third of CI's test time); run it after touching the recipe."""
    from toygraph.demo.capitals import QUESTIONS, run_demo
    assert run_demo(out=str(tmp_path / "demo")) == 0
    out = capsys.readouterr().out
    afters = [line for line in out.splitlines() if line.startswith("  after:")]
    assert len(afters) == len(QUESTIONS) and all(line.endswith("(right)") for line in afters), out
    assert f"{len(QUESTIONS)}/{len(QUESTIONS)} answers" in out and "toygraph export" in out
