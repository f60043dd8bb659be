"""Merged GGUF export: the merged file computes what base + PEFT adapter computes, in
transformers (the independent reference) and in toygraph; untouched tensors and metadata
are carried over byte for byte."""
import json
import re

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_peft_reference import ALL, peft_model, random_lora, rel, token_batch  # noqa: E402
from toygraph.adapters.files import save_gguf_adapter, save_peft  # noqa: E402
from toygraph.cli import main  # noqa: E402
from toygraph.errors import DataError  # noqa: E402
from toygraph.adapters.merge import PROVENANCE, export_merged  # noqa: E402
from toygraph.models.model import GGUFModel  # noqa: E402
from toygraph.inference.language_model import LanguageModel  # noqa: E402
from toygraph.adapters.modelfile import OLLAMA_CHATML, modelfile_text, ollama_template  # noqa: E402

# Relative loss bounds per output type (issue 15). bf16 keeps 8 mantissa bits, about as
# coarse as q8_0's int8 blocks, so it gets the quantized bound.
BOUND = {"f32": 1e-4, "f16": 1e-4, "bf16": 2e-2, "q8_0": 2e-2}


def hf_loss(model, tokens) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.double()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)).item()


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)


def fields(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}


def check_carried_over(base_path, merged_path, merged_names, out_type):
    """Untouched tensors byte-identical in their own type; merged ones in ``out_type``;
    every metadata key kept except general.name; provenance added."""
    base, out = gguf.GGUFReader(str(base_path)), gguf.GGUFReader(str(merged_path))
    assert [t.name for t in out.tensors] == [t.name for t in base.tensors]
    for b, m in zip(base.tensors, out.tensors):
        assert list(m.shape) == list(b.shape), b.name
        if b.name in merged_names:
            assert m.tensor_type == gguf.GGMLQuantizationType[out_type.upper()], b.name
        else:
            assert m.tensor_type == b.tensor_type, b.name
            assert np.asarray(m.data).tobytes() == np.asarray(b.data).tobytes(), b.name
    before, after = fields(base_path), fields(merged_path)
    assert before.pop("general.name", "x") != after.pop("general.name")
    provenance = {k: after.pop(k) for k in list(after) if k.startswith(PROVENANCE)}
    assert after == before
    assert sorted(provenance[f"{PROVENANCE}.tensors"]) == sorted(merged_names)
    assert provenance[f"{PROVENANCE}.type"] == out_type and len(provenance[f"{PROVENANCE}.sha256"]) == 64


@pytest.mark.reference
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_merged_gguf_matches_base_plus_peft(which, request, tmp_path):
    path = request.getfixturevalue(which)
    cfg = GGUFModel(path).config
    lora = random_lora(cfg, ALL, 4, b_std=0.2)
    save_peft(tmp_path / "run", lora, cfg, rank=4, alpha=8, targets=ALL)
    tokens = token_batch(path, True, 16)

    reference = hf_loss(peft_model(path, tmp_path / "run"), tokens)   # transformers + PEFT
    with_adapter, _ = LanguageModel(path, adapter_dir=tmp_path / "run").loss(tokens.tolist())
    base, _ = LanguageModel(path).loss(tokens.tolist())
    assert abs(reference - base) > 100 * 1e-4 * reference  # the adapter matters
    for out_type, bound in BOUND.items():
        merged = export_merged(path, tmp_path / "run", tmp_path / f"merged-{out_type}.gguf", out_type)
        check_carried_over(path, merged, set(lora), out_type)
        hf = hf_loss(hf_model(merged), tokens)
        mine, _ = LanguageModel(merged).loss(tokens.tolist())
        print(f"{which} {out_type}: transformers merged {hf:.7f} vs base+PEFT {reference:.7f} "
              f"(rel {rel(hf, reference):.2e}); toygraph merged {mine:.7f} vs base+adapter "
              f"{with_adapter:.7f} (rel {rel(mine, with_adapter):.2e})")
        assert rel(hf, reference) <= bound
        assert rel(mine, with_adapter) <= bound


def test_peft_dir_and_gguf_adapter_merge_to_the_same_bytes(tiny_llama, tmp_path):
    """The PEFT files hold q/k rows in Hugging Face order, the llama.cpp adapter in GGUF
    order: both must merge into the same weights. Through the CLI."""
    cfg = GGUFModel(tiny_llama).config
    lora = random_lora(cfg, ("q", "k", "v"), 4)
    save_peft(tmp_path / "run", lora, cfg, rank=4, alpha=8, targets=("q", "k", "v"))
    save_gguf_adapter(tmp_path / "run" / "adapter.gguf", lora, cfg, alpha=8, base_arch=cfg.arch)
    outs = []
    for name, adapter in (("a", tmp_path / "run"), ("b", tmp_path / "run" / "adapter.gguf")):
        outs.append(tmp_path / f"{name}.gguf")
        assert main(["export", "--model", str(tiny_llama), "--adapter", str(adapter),
                     "--out", str(outs[-1]), "--type", "f32"]) == 0
    a, b = (GGUFModel(p) for p in outs)
    for name in lora:
        assert a.tensor(name).raw.tobytes() == b.tensor(name).raw.tobytes()
    q = a.tensor("blk.0.attn_q.weight").dequantize()
    base_q = GGUFModel(tiny_llama).tensor("blk.0.attn_q.weight").dequantize()
    A, B = lora["blk.0.attn_q.weight"]
    np.testing.assert_allclose(q, base_q + 2.0 * B @ A, rtol=1e-5, atol=1e-6)


def test_export_errors(tiny_llama, tiny_llama_kquant, tmp_path, capsys):
    cfg = GGUFModel(tiny_llama).config
    save_peft(tmp_path / "run", random_lora(cfg, ("q",), 2), cfg, rank=2, alpha=4, targets=("q",))
    with pytest.raises(DataError, match="choose one of"):
        export_merged(tiny_llama, tmp_path / "run", tmp_path / "m.gguf", "q4_0")
    with pytest.raises(DataError, match="no such run directory"):
        export_merged(tiny_llama, tmp_path / "nothing", tmp_path / "m.gguf")
    with pytest.raises(DataError, match="overwrite the base model"):
        export_merged(tiny_llama, tmp_path / "run", tiny_llama)
    # An adapter made for another model (other widths) is refused, and nothing is written.
    assert main(["export", "--model", str(tiny_llama_kquant), "--adapter", str(tmp_path / "run"),
                 "--out", str(tmp_path / "m.gguf")]) == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.slow
@pytest.mark.reference
def test_merged_smollm2_q8_0(smollm2, tmp_path):
    cfg = GGUFModel(smollm2).config
    save_peft(tmp_path / "run", random_lora(cfg, ("q", "v"), 8, b_std=0.05), cfg, rank=8,
              alpha=16, targets=("q", "v"))
    tokens = token_batch(smollm2, False, 16).tolist()
    with_adapter, _ = LanguageModel(smollm2, adapter_dir=tmp_path / "run").loss(tokens)
    merged = export_merged(smollm2, tmp_path / "run", tmp_path / "m.gguf", "q8_0")
    mine, _ = LanguageModel(merged).loss(tokens)
    print(f"SmolLM2 q8_0: toygraph merged {mine:.6f} vs base+adapter {with_adapter:.6f} "
          f"(rel {rel(mine, with_adapter):.2e})")
    assert rel(mine, with_adapter) <= BOUND["q8_0"]


def test_training_run_writes_an_ollama_modelfile(tiny_llama, tmp_path):
    """The run directory's Modelfile: FROM the base by absolute path, ADAPTER resolving
    (relative to the Modelfile, as Ollama resolves it) to an adapter llama.cpp accepts
    for that base, and the end-of-turn tokens as stop parameters."""
    import json

    from toygraph.adapters.files import check_gguf_adapter
    from toygraph.training import RunConfig, run_training

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "response": f"it is {i}"}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    run_training(RunConfig(model=str(tiny_llama), data=str(data), out=str(out), steps=2,
                             batch=2, seq_len=32, val_split=0.0, quiet=True))
    text = (out / "Modelfile").read_text()
    # Modelfile syntax: "# comment" lines, or INSTRUCTION value with """multi-line""" values.
    commands = re.findall(r'^([A-Z]+) ("""[\s\S]*?"""|.*)$', text, re.M)
    rest = re.sub(r'^([A-Z]+) ("""[\s\S]*?"""|.*)$', "", text, flags=re.M)
    assert all(not l or l.startswith("#") for l in rest.splitlines())
    values = {}
    for c, v in commands:
        values.setdefault(c, []).append(v)
    assert set(values) == {"FROM", "ADAPTER", "TEMPLATE", "PARAMETER"}   # no SYSTEM for tiny
    (base,), (adapter,) = values["FROM"], values["ADAPTER"]
    assert base == str(tiny_llama.resolve()) and adapter == "./adapter.gguf"
    assert check_gguf_adapter(out / adapter, base)["rank"] == 8
    assert values["TEMPLATE"] == [f'"""{OLLAMA_CHATML}"""']   # tiny's template is ChatML
    # tiny vocabulary: <|endoftext|> is EOS, <|im_end|> ends a ChatML turn
    assert sorted(values["PARAMETER"]) == ['stop "<|endoftext|>"', 'stop "<|im_end|>"']


def test_ollama_template_only_when_faithful(tiny_llama):
    from toygraph.fixtures.tiny_models import CHATML
    from toygraph.gguf.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(tiny_llama)
    assert ollama_template(tok) == (OLLAMA_CHATML, None, "ChatML")
    # ChatML with a default system message (SmolLM2's shape): Ollama's SYSTEM carries it.
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
                         "You are a helpful bot<|im_end|>\\n' }}{% endif %}" + CHATML)
    assert ollama_template(tok) == (OLLAMA_CHATML, "You are a helpful bot", "ChatML")
    for other in (
        CHATML.replace("'\\n' + message['content']", "message['content']"),  # no newline
        "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",  # llama-2 style
        "{{ bos_token }}" + CHATML,                                           # prints BOS
        "{{ raise_exception('no') }}",
    ):
        tok.chat_template = other
        assert ollama_template(tok) is None, other
    tok.chat_template = None
    assert ollama_template(tok) is None


def test_smollm2_modelfile_keeps_its_default_system_message(smollm2):
    text = modelfile_text(smollm2)
    assert f'TEMPLATE """{OLLAMA_CHATML}"""' in text
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and f"FROM {smollm2.resolve()}" in text


def test_an_adapter_already_merged_in_is_not_applied_twice(tiny_llama, tmp_path):
    """export and generate refuse an adapter whose bytes the model records as merged in
    (toygraph.merged_adapter.sha256); --allow-merged lets it through."""
    from toygraph.cli import main
    from toygraph.training import RunConfig, run_training
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Q{i}?", "response": "A."}) + "\n"
                            for i in range(4)))
    run = tmp_path / "run"
    run_training(RunConfig(model=str(tiny_llama), data=str(data), out=str(run), steps=1,
                           batch=2, seq_len=32, val_split=0, rank=2, quiet=True))
    merged = export_merged(tiny_llama, run, tmp_path / "m.gguf", "f32")
    with pytest.raises(DataError, match=r"already has the adapter .* merged in .* --allow-merged"):
        export_merged(merged, run, tmp_path / "m2.gguf", "f32")
    with pytest.raises(DataError, match="--allow-merged"):
        LanguageModel(merged, adapter_dir=run)
    assert main(["generate", "--model", str(merged), "--adapter", str(run), "--prompt", "Q1?",
                 "--max-new-tokens", "1"]) == 2
    export_merged(merged, run, tmp_path / "m3.gguf", "f32", allow_merged=True)   # meant: fine
    LanguageModel(merged, adapter_dir=run, allow_merged=True)


@pytest.mark.parametrize("system", ['Say "hi"', "Ends with a backslash\\", 'Has """ inside'])
def test_a_system_message_the_modelfile_cannot_quote_is_not_written(tiny_llama, system):
    from toygraph.fixtures.tiny_models import CHATML
    from toygraph.gguf.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(tiny_llama)
    tok.use_template("probe", "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
                     + system.replace("\\", "\\\\").replace("'", "\\'") + "<|im_end|>\\n' }}{% endif %}"
                     + CHATML)
    assert ollama_template(tok) is None
