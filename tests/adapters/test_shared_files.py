"""Files meant to be shared carry no machine paths (issue 46 item 10): a merged GGUF and a
run's exported adapters record names (the run's, the base file's, a Jinja template file's)
and digests, never the absolute paths they were made from (a home directory, a user)."""
import json

import gguf
import pytest

from test_cli import run
from test_run import write_chat_data
from toygraph.adapters.merge import PROVENANCE
from toygraph.atomic import file_sha256


def strings_of_gguf(path) -> list[str]:
    """Every string value in a GGUF's metadata (arrays of strings included)."""
    out = []
    for field in gguf.GGUFReader(str(path)).fields.values():
        value = field.contents()
        out += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    return out


def safetensors_metadata(path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)).get("__metadata__", {})


@pytest.fixture
def trained(tiny_llama, tmp_path, capsys):
    """A run in a directory whose path names its machine, trained with a Jinja template
    from a file there (its name was its absolute path)."""
    home = tmp_path / "home" / "alice"
    template = home / "templates" / "mine.jinja"
    template.parent.mkdir(parents=True)
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    data = write_chat_data(tmp_path / "chat.jsonl")
    out = home / "runs" / "capitals"
    code, _, err = run(capsys, "finetune", "--model", str(tiny_llama), "--data", str(data),
                       "--out", str(out), "--steps", "2", "--batch", "2", "--seq-len", "32",
                       "--rank", "2", "--val-split", "0", "--template", str(template),
                       "--quiet")
    assert code == 0, err
    return home, out


def test_a_merged_gguf_records_names_not_paths(trained, tiny_llama, tmp_path, capsys):
    home, out = trained
    merged = tmp_path / "merged.gguf"
    code, _, err = run(capsys, "export", "--model", str(tiny_llama), "--adapter", str(out),
                       "--out", str(merged))
    assert code == 0, err
    values = strings_of_gguf(merged)
    leaked = [v for v in values if str(tmp_path) in v or "alice" in v]
    assert leaked == []
    meta = {f.name: f.contents() for f in gguf.GGUFReader(str(merged)).fields.values()}
    assert meta[f"{PROVENANCE}.source"] == "capitals"
    assert meta[f"{PROVENANCE}.base"] == tiny_llama.name
    assert meta[f"{PROVENANCE}.template"] == "mine.jinja"
    assert meta[f"{PROVENANCE}.sha256"] == file_sha256(out / "adapter_model.safetensors")


def test_a_merged_gguf_from_an_adapter_file_records_its_name(trained, tiny_llama, tmp_path,
                                                             capsys):
    _, out = trained
    merged = tmp_path / "merged.gguf"
    assert run(capsys, "export", "--model", str(tiny_llama), "--adapter",
               str(out / "adapter.gguf"), "--out", str(merged))[0] == 0
    meta = {f.name: f.contents() for f in gguf.GGUFReader(str(merged)).fields.values()}
    assert meta[f"{PROVENANCE}.source"] == "adapter.gguf"
    assert not [v for v in strings_of_gguf(merged) if str(tmp_path) in v]


def test_a_runs_adapter_files_record_no_paths(trained, tmp_path):
    home, out = trained
    meta = safetensors_metadata(out / "adapter_model.safetensors")
    assert meta["toygraph.template"] == "mine.jinja"
    config = (out / "adapter_config.json").read_text()
    for text in [*meta.values(), config, *strings_of_gguf(out / "adapter.gguf")]:
        assert str(tmp_path) not in text and "alice" not in text
