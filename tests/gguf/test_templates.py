"""One prompt format per model, used everywhere (toygraph/gguf/templates.py): a base model
without a chat template trains in the default one, and generate --chat, chat, the
Modelfile's TEMPLATE and the merged GGUF render the prompt as training did."""
from __future__ import annotations

import io
import json

import pytest

from toygraph.adapters.files import adapter_template
from toygraph.adapters.merge import PROVENANCE, export_merged
from toygraph.adapters.modelfile import _alpaca, modelfile_text, ollama_alpaca
from toygraph.cli import main
from toygraph.data.encoding import encode_example
from toygraph.data.examples import Example
from toygraph.errors import DataError
from toygraph.fixtures.tiny_models import write_tiny_llama
from toygraph.gguf.templates import (ALPACA, CHATML, DEFAULT, TEMPLATES, bos_first,
                                      choose_template)
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.inference.chat import chat_loop
from toygraph.inference.language_model import LanguageModel
from toygraph.models.model import GGUFModel
from toygraph.training import RunConfig, run_training

QUESTION = "Name a colour."


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny llama GGUF with no tokenizer.chat_template: a base model."""
    return write_tiny_llama(tmp_path_factory.mktemp("base") / "base.gguf", chat_template="")


@pytest.fixture(scope="module")
def trained(base_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    data = folder / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Name colour {i}.", "response": c}) + "\n"
                            for i, c in enumerate(["red", "green", "blue", "teal"] * 2)))
    out = folder / "run"
    run_training(RunConfig(model=str(base_model), data=str(data), out=str(out), steps=2,
                           batch=2, seq_len=48, val_split=0, rank=2, quiet=True))
    return out


def test_a_model_without_a_template_gets_the_default(base_model, tiny_llama, tmp_path):
    tok = Tokenizer.from_gguf(base_model)
    assert tok.file_chat_template is None and tok.template_name == DEFAULT == "alpaca"
    assert choose_template(tok, "chatml") == ("chatml", CHATML)
    with pytest.raises(DataError, match="--template gguf: .* has no chat template"):
        choose_template(tok, "gguf")
    with pytest.raises(DataError, match="--template nope: neither a template name"):
        choose_template(tok, "nope")
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert choose_template(tok, str(jinja)) == (str(jinja.resolve()), jinja.read_text())
    assert Tokenizer.from_gguf(tiny_llama).template_name == "gguf"   # a file's own comes first


def test_the_run_records_its_template_and_every_use_renders_as_training(trained, base_model):
    assert adapter_template(trained) == ("alpaca", ALPACA)
    assert "template" in (trained / "run.yaml").read_text()
    # the prompt training saw before the reply ...
    tok = Tokenizer.from_gguf(base_model)
    row = encode_example(Example(messages=[{"role": "user", "content": QUESTION},
                                           {"role": "assistant", "content": "red"}]), tok, 64)
    trained_prompt = row.tokens[:row.target_mask.tolist().index(True)].tolist()
    # ... is what generate --chat and chat give the model with the adapter
    lm = LanguageModel(base_model, adapter_dir=trained)
    assert lm.tokenizer.template_name == "alpaca"
    assert lm.encode_prompt(QUESTION, chat=True) == trained_prompt
    out = io.StringIO()
    chat_loop(lm, io.StringIO(QUESTION + "\n"), out, max_new_tokens=4)
    assert out.getvalue() == lm.generate(QUESTION, chat=True, max_new_tokens=4) + "\n"


def test_the_modelfile_carries_the_runs_template(trained, base_model):
    text = (trained / "Modelfile").read_text()
    eos = Tokenizer.from_gguf(base_model).eos_token
    assert f'TEMPLATE """{ollama_alpaca(eos)}"""' in text
    assert text == modelfile_text(base_model, template=adapter_template(trained))
    # its Go template's Python mirror renders a conversation as training's Jinja does
    tok = Tokenizer.from_gguf(base_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert _alpaca(messages, eos) == tok.apply_chat_template(messages, add_generation_prompt=True)


def test_the_merged_gguf_is_written_with_the_template(trained, base_model, tmp_path):
    merged = export_merged(base_model, trained, tmp_path / "m.gguf", "f32")
    tok = Tokenizer.from_gguf(merged)
    assert tok.file_chat_template == ALPACA and tok.template_name == "gguf"
    assert GGUFModel(merged).metadata(f"{PROVENANCE}.template") == "alpaca"
    base_tok = Tokenizer.from_gguf(base_model)
    conv = [{"role": "user", "content": QUESTION}]
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == \
        base_tok.apply_chat_template(conv, add_generation_prompt=True)


def test_a_merged_gguf_whose_vocabulary_adds_bos_prints_it_first(tmp_path):
    """A reader that renders the file's template and adds no BOS itself (llama-cpp-python's
    chat completion; a Gemma 3 base asked that way answered nothing) gets the BOS from the
    template; toygraph (and llama.cpp) strip it where they add their own: one BOS."""
    base = write_tiny_llama(tmp_path / "bos.gguf", chat_template="", add_bos=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Name colour {i}.", "response": c}) + "\n"
                            for i, c in enumerate(["red", "green", "blue", "teal"] * 2)))
    run = tmp_path / "run"
    run_training(RunConfig(model=str(base), data=str(data), out=str(run), steps=1, batch=2,
                           seq_len=48, val_split=0, rank=2, quiet=True))
    merged = export_merged(base, run, tmp_path / "m.gguf", "f32")
    tok, base_tok = Tokenizer.from_gguf(merged), Tokenizer.from_gguf(base)
    assert base_tok.add_bos_token and base_tok.bos_token
    assert tok.file_chat_template == "{{ bos_token }}" + ALPACA
    conv = [{"role": "user", "content": QUESTION}]
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == \
        base_tok.bos_token + base_tok.apply_chat_template(conv, add_generation_prompt=True)
    ids = LanguageModel(merged, allow_merged=True).encode_prompt(conv, chat=True)
    assert ids == LanguageModel(base, adapter_dir=run).encode_prompt(conv, chat=True)
    assert ids.count(base_tok.bos_id) == 1


def test_bos_first_leaves_a_template_that_prints_it_and_a_vocabulary_without_it(base_model):
    tok = Tokenizer.from_gguf(base_model)
    tok.add_bos_token = True
    printed = "{{ bos_token }}" + ALPACA
    tok.use_template("mine", printed)
    assert bos_first(printed, tok) == printed
    tok.use_template("alpaca", ALPACA)
    assert bos_first(ALPACA, tok) == "{{ bos_token }}" + ALPACA
    tok.add_bos_token = False   # a BPE vocabulary that adds none (SmolLM2, Qwen)
    assert bos_first(ALPACA, tok) == ALPACA


def test_template_flags(trained, base_model, tiny_llama, tmp_path, capsys):
    """--template on generate overrides the adapter's; finetune --template chatml records it."""
    assert main(["generate", "--model", str(base_model), "--adapter", str(trained), "--chat",
                 "--prompt", QUESTION, "--max-new-tokens", "2", "--template", "chatml"]) == 0
    capsys.readouterr()
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "Hi?", "response": "Hello."}) + "\n" * 1)
    out = tmp_path / "chatml"
    assert main(["finetune", "--model", str(tiny_llama), "--data", str(data), "--out", str(out),
                 "--steps", "1", "--batch", "1", "--seq-len", "32", "--val-split", "0",
                 "--template", "chatml", "--quiet"]) == 0
    assert adapter_template(out) == ("chatml", TEMPLATES["chatml"])
    capsys.readouterr()
