"""models/stores.py: --model by name in Ollama's store, the Hugging Face hub cache and LM
Studio's folder; ``toygraph models``; ``--to-ollama``. Every store here is a temporary
folder laid out as its program lays it out, holding the tiny fixture GGUF."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from toygraph.cli import main
from toygraph.errors import ToygraphError
from toygraph.models import stores
from toygraph.models.catalog import resolve_model, resolve_source
from toygraph.training.prepare import size_text

TEMPLATE = "{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
PARAMS = {"stop": ["<|im_start|>", "<|im_end|>"], "temperature": 0.6, "top_k": 20}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def add_ollama_model(root: Path, manifest: str, gguf: Path, **layers) -> dict:
    """Ollama's layout: ``manifests/<manifest>`` listing the GGUF and ``layers`` (media type
    suffix -> bytes) as blobs named by their sha256. Returns the manifest."""
    entries = [{"mediaType": stores.MEDIA + "model", **_blob(root, gguf.read_bytes())}]
    entries += [{"mediaType": stores.MEDIA + kind, **_blob(root, data)} for kind, data in layers.items()]
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      **_blob(root, b"{}")}, "layers": entries}
    path = root / "manifests" / manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return doc


@pytest.fixture
def ollama_store(tmp_path, monkeypatch, tiny_llama):
    """A store holding tiny:1b (with template, system and params layers) and tiny:latest."""
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    add_ollama_model(root, "registry.ollama.ai/library/tiny/1b", tiny_llama,
                     template=TEMPLATE.encode(), system=b"You are tiny.",
                     params=json.dumps(PARAMS).encode(), license=b"MIT")
    add_ollama_model(root, "registry.ollama.ai/library/tiny/latest", tiny_llama)
    return root


def test_an_ollama_model_evaluates_exactly_as_its_file(capsys, ollama_store, tiny_llama):
    for argv in (["--tokens", "5,9,14,3,7"], ["--text", "the cat sat on the mat"]):
        by_path = run(capsys, "eval", "--model", tiny_llama, *argv, "--json")
        by_name = run(capsys, "eval", "--model", "ollama:tiny:1b", *argv, "--json")
        assert by_path[0] == by_name[0] == 0, by_name[2]
        assert json.loads(by_name[1]) == json.loads(by_path[1])   # the same loss, bit for bit


def test_the_ollama_layers_are_read_and_the_blob_is_the_gguf(ollama_store, tiny_llama):
    source = resolve_source("ollama:tiny:1b")
    assert source.path.read_bytes() == tiny_llama.read_bytes()
    assert source.path.parent == ollama_store / "blobs" and source.store == "ollama"
    assert (source.ollama_name, source.template, source.system, source.params) == \
        ("tiny:1b", TEMPLATE, "You are tiny.", PARAMS)
    assert source.warnings == []   # a license layer is not needed, and not worth a word


@pytest.mark.parametrize("name,parts", [
    ("tiny", ("registry.ollama.ai", "library", "tiny", "latest")),
    ("tiny:1b", ("registry.ollama.ai", "library", "tiny", "1b")),
    ("me/tiny:v2", ("registry.ollama.ai", "me", "tiny", "v2")),
    ("hf.co/org/tiny-GGUF:Q4_K_M", ("hf.co", "org", "tiny-GGUF", "Q4_K_M")),
    ("localhost:5000/me/tiny", ("localhost:5000", "me", "tiny", "latest")),
])
def test_ollama_names_default_like_ollama(name, parts):
    assert stores.parse_ollama_name(name) == parts
    expected = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
    assert stores.ollama_display_name(*parts) in (expected, f"{parts[2]}:{parts[3]}")


@pytest.mark.parametrize("bad", ["", "a//b", "a/b/c/d", "tiny:", "/tiny", "../../x", "..",
                                 "me/..", "tiny:..", ".hidden", "a/b/../../x", "ti\x1bny"])
def test_a_malformed_ollama_name_is_refused(bad):
    with pytest.raises(ToygraphError, match="not an Ollama model name"):
        stores.parse_ollama_name(bad)


def test_tag_defaulting_and_namespaced_names_resolve(ollama_store, tiny_llama):
    add_ollama_model(ollama_store, "registry.ollama.ai/me/tiny/v2", tiny_llama)
    add_ollama_model(ollama_store, "example.com/team/tiny/latest", tiny_llama)
    blob = resolve_source("ollama:tiny:1b").path
    for name in ("ollama:tiny", "ollama:me/tiny:v2", "ollama:example.com/team/tiny"):
        assert Path(resolve_model(name)) == blob, name
    assert resolve_source("ollama:me/tiny:v2").ollama_name == "me/tiny:v2"
    assert resolve_source("ollama:example.com/team/tiny").ollama_name == "example.com/team/tiny:latest"


def test_a_missing_manifest_names_the_path_and_lists_the_store(capsys, ollama_store):
    code, _, err = run(capsys, "eval", "--model", "ollama:nope:7b", "--tokens", "1,2")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(ollama_store / "manifests/registry.ollama.ai/library/nope/7b") in err
    assert "the store has tiny:1b, tiny:latest" in err


def test_missing_and_damaged_blobs_are_one_line_errors(ollama_store, tiny_llama, monkeypatch):
    blob = resolve_source("ollama:tiny:1b").path
    data = blob.read_bytes()
    blob.write_bytes(data[:-1])
    with pytest.raises(ToygraphError, match=r"has \d+ bytes, the manifest says \d+ \(a partial"):
        resolve_model("ollama:tiny")
    blob.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))   # the same size, other bytes
    with pytest.raises(ToygraphError, match="does not have the sha256 its name says"):
        resolve_model("ollama:tiny")
    # a GGUF above HASH_LIMIT is trusted by its size (Ollama checked its digest on pull)
    monkeypatch.setattr(stores, "HASH_LIMIT", len(data) - 1)
    assert Path(resolve_model("ollama:tiny")) == blob
    blob.unlink()
    with pytest.raises(ToygraphError, match=f"blob {blob} is missing"):
        resolve_model("ollama:tiny")


def test_a_damaged_small_layer_is_refused_whatever_the_limit(ollama_store, monkeypatch):
    monkeypatch.setattr(stores, "HASH_LIMIT", 0)
    manifest = json.loads((ollama_store / "manifests/registry.ollama.ai/library/tiny/1b").read_text())
    system = next(layer for layer in manifest["layers"] if layer["mediaType"].endswith("system"))
    (ollama_store / "blobs" / system["digest"].replace(":", "-")).write_bytes(b"You are TINY.")
    with pytest.raises(ToygraphError, match="sha256"):
        resolve_source("ollama:tiny:1b")


def test_an_adapter_layer_is_refused_and_a_projector_is_left_out_with_a_warning(
        capsys, ollama_store, tiny_llama):
    add_ollama_model(ollama_store, "registry.ollama.ai/library/tuned/latest", tiny_llama,
                     adapter=b"GGUF-lora")
    code, _, err = run(capsys, "eval", "--model", "ollama:tuned", "--tokens", "1,2")
    assert code == 2 and err.count("\n") == 1 and "has an adapter layer" in err
    add_ollama_model(ollama_store, "registry.ollama.ai/library/vision/latest", tiny_llama,
                     projector=b"GGUF-clip")
    code, out, err = run(capsys, "eval", "--model", "ollama:vision", "--tokens", "1,2", "--json")
    assert code == 0 and "ollama:vision: a vision projector" in err and json.loads(out)["tokens"] == 1


def test_a_manifest_that_is_not_json_is_one_line(ollama_store):
    (ollama_store / "manifests/registry.ollama.ai/library/tiny/latest").write_text("{oops")
    with pytest.raises(ToygraphError, match="not valid JSON"):
        resolve_model("ollama:tiny")


def test_an_ollama_name_never_leads_out_of_the_store(capsys, ollama_store, tmp_path, tiny_llama):
    """``ollama:../../x`` named manifests/../../x/latest: a manifest outside the store."""
    outside = tmp_path / "x" / "latest"   # = <store>/manifests/../../x/latest
    outside.parent.mkdir(parents=True)
    outside.write_text((ollama_store / "manifests/registry.ollama.ai/library/tiny/1b").read_text())
    code, _, err = run(capsys, "eval", "--model", "ollama:../../x", "--tokens", "1,2")
    assert code == 2 and err.count("\n") == 1 and "not an Ollama model name" in err, err
    # nor a manifest that is a link out of the store
    link = ollama_store / "manifests/registry.ollama.ai/library/linked/latest"
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)
    with pytest.raises(ToygraphError, match="leads outside the store's manifests folder"):
        resolve_source("ollama:linked")


def test_a_digest_must_be_hex_and_its_blob_inside_the_store(ollama_store, tmp_path, monkeypatch):
    """A 64-character non-hex digest named a file outside blobs/, checked by size only
    when HASH_LIMIT let the hash go."""
    monkeypatch.setattr(stores, "HASH_LIMIT", 0)
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF" + bytes(60))
    (ollama_store / "blobs" / "sha256-..").mkdir()   # a hostile store's folder
    digest = "sha256:.." + "/." * 20 + "//../../../secret.gguf"   # blobs/sha256-../../../..
    assert len(digest) == 71 and (ollama_store / "blobs" / f"sha256-{digest[7:]}").resolve() == secret
    path = ollama_store / "manifests/registry.ollama.ai/library/tiny/latest"
    doc = json.loads(path.read_text())
    doc["layers"][0].update(digest=digest, size=64)
    path.write_text(json.dumps(doc))
    with pytest.raises(ToygraphError, match="has no sha256 digest"):
        resolve_source("ollama:tiny")
    doc["layers"][0].update(digest="sha256:" + "A" * 64)   # upper case is not Ollama's
    path.write_text(json.dumps(doc))
    with pytest.raises(ToygraphError, match="has no sha256 digest"):
        resolve_source("ollama:tiny")


def test_a_deeply_nested_manifest_is_one_line_and_the_listing_goes_on(capsys, ollama_store):
    bad = ollama_store / "manifests/registry.ollama.ai/library/deep/latest"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"layers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, _, err = run(capsys, "eval", "--model", "ollama:deep", "--tokens", "1,2")
    assert code == 2 and err.count("\n") == 1 and "JSON nested 100001 levels deep" in err, err
    code, out, err = run(capsys, "models")
    assert code == 0 and "Traceback" not in err, err
    assert "--model ollama:tiny:1b" in out and "--model ollama:tiny:latest" in out
    assert "  skipped ollama:deep:latest: " in out and "nested 100001 levels" in out, out
    code, out, _ = run(capsys, "models", "--json")
    rows = {r["model"]: r for r in map(json.loads, out.splitlines())}
    assert "nested" in rows["ollama:deep:latest"]["skipped"] and "skipped" not in rows["ollama:tiny:1b"]


@pytest.mark.parametrize("params, needle", [
    (b'{"stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nested 100001 levels deep"),
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'["stop"]', "the params layer is not a JSON object"),
    (b'{"stop": "\xff"}', "not UTF-8 text"),
])
def test_a_hostile_params_layer_is_one_line(capsys, ollama_store, tiny_llama, params, needle):
    add_ollama_model(ollama_store, "registry.ollama.ai/library/p/latest", tiny_llama, params=params)
    code, _, err = run(capsys, "eval", "--model", "ollama:p", "--tokens", "1,2")
    assert code == 2 and err.count("\n") == 1 and needle in err and "the params layer" in err, err


def _hf_cache(root: Path, repo: str, files: dict[str, Path], rev: str = "abc123") -> Path:
    """The hub client's layout: blobs by hash, snapshot files linking to them, refs/main."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(rev)
    for name, src in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, blob)
        link = repo_dir / "snapshots" / rev / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return repo_dir


def test_hf_cache_files_resolve_without_download(capsys, tmp_path, monkeypatch, tiny_llama):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = tmp_path / "hf" / "hub"
    _hf_cache(hub, "org/Tiny-GGUF", {"tiny-Q8_0.gguf": tiny_llama, "sub/tiny-f16.gguf": tiny_llama})
    path = Path(resolve_model("hf:org/Tiny-GGUF/tiny-Q8_0.gguf"))
    assert path == hub / "models--org--Tiny-GGUF/snapshots/abc123/tiny-Q8_0.gguf"
    assert path.read_bytes() == tiny_llama.read_bytes()
    assert Path(resolve_model("hf:org/Tiny-GGUF/sub/tiny-f16.gguf")).is_file()
    by_path = run(capsys, "eval", "--model", tiny_llama, "--tokens", "5,9,14", "--json")
    by_name = run(capsys, "eval", "--model", "hf:org/Tiny-GGUF/tiny-Q8_0.gguf", "--tokens", "5,9,14", "--json")
    assert by_name == by_path
    with pytest.raises(ToygraphError, match="no tiny-Q4.gguf in .*; its GGUFs: sub/tiny-f16.gguf, tiny-Q8_0.gguf"):
        resolve_model("hf:org/Tiny-GGUF/tiny-Q4.gguf")
    with pytest.raises(ToygraphError, match=f"no models--org--Other in the hub cache {hub}; GGUF repos there: org/Tiny-GGUF"):
        resolve_model("hf:org/Other/x.gguf")
    with pytest.raises(ToygraphError, match="give hf:ORG/REPO/FILE.gguf"):
        resolve_model("hf:org/Tiny-GGUF")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))   # it wins over HF_HOME
    with pytest.raises(ToygraphError, match="elsewhere; it holds no GGUF repos"):
        resolve_model("hf:org/Tiny-GGUF/tiny-Q8_0.gguf")


def test_hf_names_and_refs_never_leave_the_hub_cache(capsys, tmp_path, monkeypatch, tiny_llama):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = _hf_cache(hub, "org/Tiny-GGUF", {"tiny.gguf": tiny_llama})
    shutil.copy(tiny_llama, tmp_path / "x.gguf")   # = snapshots/abc123/../../../../x.gguf
    with pytest.raises(ToygraphError, match="no '.' or '..' parts"):
        resolve_model("hf:org/Tiny-GGUF/../../../../x.gguf")
    # a refs/main holding a path: the snapshot would be a folder far out of the cache
    (repo / "refs" / "main").write_text("../../..")
    with pytest.raises(ToygraphError, match=r"refs/main: holds '../../..', not a commit hash"):
        resolve_model("hf:org/Tiny-GGUF/x.gguf")
    _hf_cache(hub, "org/Good-GGUF", {"good.gguf": tiny_llama})
    code, out, err = run(capsys, "models")   # never walks the tree refs/main pointed at
    assert code == 0 and "--model hf:org/Good-GGUF/good.gguf" in out, err
    assert "--model hf:org/Tiny-GGUF" not in out
    assert f"  skipped {repo}: " in out and "not a commit hash" in out, out
    # a snapshot file linking out of the cache is not listed as the repo's
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots/abc123/out.gguf").symlink_to(tmp_path / "x.gguf")
    with pytest.raises(ToygraphError, match="leads outside the hub cache"):
        resolve_model("hf:org/Tiny-GGUF/out.gguf")
    skipped: list = []
    assert [f for _, _, f, _ in stores.hf_ggufs(skipped=skipped)] == ["good.gguf", "tiny.gguf"]
    assert [p.name for p, _ in skipped] == ["out.gguf"]


def test_lmstudio_by_path_or_unique_part(tmp_path, monkeypatch, tiny_llama):
    root = tmp_path / "lms"
    monkeypatch.setenv("LMSTUDIO_MODELS", str(root))
    for rel in ("pub/Tiny-GGUF/tiny-Q8_0.gguf", "pub/Tiny-GGUF/tiny-Q4_K_M.gguf",
                "pub/Tiny-GGUF/mmproj-tiny-f16.gguf", "other/Big-GGUF/big-Q4_K_M.gguf"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny_llama, root / rel)
    assert resolve_model("lmstudio:pub/Tiny-GGUF/tiny-Q8_0.gguf") == str(root / "pub/Tiny-GGUF/tiny-Q8_0.gguf")
    assert resolve_model("lmstudio:big") == str(root / "other/Big-GGUF/big-Q4_K_M.gguf")
    with pytest.raises(ToygraphError, match="no GGUF in .* matches"):
        resolve_model("lmstudio:tiny-f16")   # only the projector has it: not matched by a part
    assert Path(resolve_model("lmstudio:pub/Tiny-GGUF/mmproj-tiny-f16.gguf")).is_file()  # by path
    with pytest.raises(ToygraphError, match="2 GGUFs in .* match: pub/Tiny-GGUF/tiny-Q4_K_M.gguf, "
                                            "pub/Tiny-GGUF/tiny-Q8_0.gguf"):
        resolve_model("lmstudio:tiny-Q")


def test_toygraph_models_lists_every_store(capsys, ollama_store, tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _hf_cache(tmp_path / "hub", "org/Tiny-GGUF", {"tiny.gguf": tiny_llama})
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "lms"))
    (tmp_path / "lms/pub/Tiny-GGUF").mkdir(parents=True)
    shutil.copy(tiny_llama, tmp_path / "lms/pub/Tiny-GGUF/tiny.gguf")
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "cache"))   # the catalog: not cached
    monkeypatch.delenv("TOYGRAPH_SMOLLM2", raising=False)
    monkeypatch.delenv("TOYGRAPH_GEMMA3_270M", raising=False)
    monkeypatch.setattr("toygraph.models.catalog._installed_copy", lambda: None)
    code, out, _ = run(capsys, "models")
    assert code == 0
    lines = [line.split() for line in out.splitlines() if line.startswith("  --model")]
    named = {words[1]: words[2:] for words in lines}
    assert named["smollm2"] == ["not", "cached"] and named["gemma3-270m"] == ["not", "cached"]
    for name in ("ollama:tiny:1b", "ollama:tiny:latest", "hf:org/Tiny-GGUF/tiny.gguf",
                 "lmstudio:pub/Tiny-GGUF/tiny.gguf"):
        assert " ".join(named[name]) == size_text(tiny_llama.stat().st_size), name
        assert resolve_model(name)   # each listed string resolves
    assert f"Ollama ({ollama_store})" in out and f"Hugging Face hub cache ({tmp_path / 'hub'})" in out
    code, out, _ = run(capsys, "models", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["model"] for r in rows if r["store"] == "ollama"] == ["ollama:tiny:1b", "ollama:tiny:latest"]
    assert all(r["size"] == tiny_llama.stat().st_size for r in rows if r["store"] != "catalog")


def _train(capsys, model, data, out, *extra):
    return run(capsys, "finetune", "--model", model, "--data", data, "--out", out, "--steps", "2",
               "--batch", "2", "--seq-len", "32", "--rank", "2", "--targets", "q,v",
               "--val-split", "0", "--quiet", *extra)


@pytest.fixture
def chat_data(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))
    return data


def test_to_ollama_runs_ollama_create_on_a_modelfile_from_the_ollama_model(
        capsys, ollama_store, chat_data, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ollama"   # records its argv and the Modelfile it was given
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$(dirname "$0")/argv"\n'
                    'cp "$4" "$(dirname "$0")/Modelfile.seen"\necho "success"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "run"
    code, stdout, err = _train(capsys, "ollama:tiny:1b", chat_data, out, "--to-ollama", "tiny-tuned:v1")
    assert code == 0, err
    summary = json.loads(stdout.splitlines()[-1])
    assert summary["final"]["ollama"]["created"] is True
    assert (bin_dir / "argv").read_text().split("\n")[:4] == ["create", "tiny-tuned:v1", "-f",
                                                             str(out / "Modelfile")]
    text = (bin_dir / "Modelfile.seen").read_text()
    assert text == (out / "Modelfile").read_text()
    commands = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert "FROM tiny:1b" in commands and "ADAPTER ./adapter.gguf" in commands
    assert 'SYSTEM """You are tiny."""' in commands   # the Ollama model's system layer
    params = [c for c in commands if c.startswith("PARAMETER")]
    assert params == ['PARAMETER stop "<|endoftext|>"', 'PARAMETER stop "<|im_end|>"',
                      'PARAMETER stop "<|im_start|>"', "PARAMETER temperature 0.6",
                      "PARAMETER top_k 20"]
    # the run trained with the GGUF's ChatML, whose Go form replaces the layer's (which differs)
    assert any(c.startswith('TEMPLATE """') for c in commands)
    assert "replaces the Ollama model's own template layer" in text
    # the run keeps the name (run.yaml repeats it; the adapter says what it was trained on)
    assert "model: ollama:tiny:1b\n" in (out / "run.yaml").read_text()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "ollama:tiny:1b"


def test_without_ollama_on_path_the_command_is_printed(capsys, chat_data, tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "run"
    code, stdout, err = _train(capsys, tiny_llama, chat_data, out, "--to-ollama", "mine")
    assert code == 0, err
    ollama = json.loads(stdout.splitlines()[-1])["final"]["ollama"]
    assert ollama == {"name": "mine", "created": False,
                      "command": f"ollama create mine -f {out / 'Modelfile'}",
                      "message": "ollama is not on PATH; create the model with:\n  "
                                 f"ollama create mine -f {out / 'Modelfile'}"}
    assert f"FROM {tiny_llama.resolve()}\n" in (out / "Modelfile").read_text()   # not from Ollama


def test_a_failing_ollama_create_is_reported_not_raised(tmp_path, monkeypatch):
    from toygraph.adapters.modelfile import ollama_create
    fake = tmp_path / "ollama"
    fake.write_text("#!/bin/sh\necho 'Error: pull model manifest: file does not exist' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    result = ollama_create("mine", tmp_path / "Modelfile")
    assert result["created"] is False
    assert result["message"].endswith("failed (exit 1): Error: pull model manifest: file does not exist")


@pytest.mark.parametrize("extra,needle", [
    (["--to-ollama", "bad name"], "--to-ollama 'bad name' is not an Ollama model name"),
    (["--to-ollama", "ok", "--recipe", "full"], "--to-ollama is for --recipe"),
])
def test_to_ollama_bad_uses_are_one_line(capsys, chat_data, tmp_path, tiny_llama, extra, needle):
    code, _, err = _train(capsys, tiny_llama, chat_data, tmp_path / "run", *extra)
    assert code == 2 and needle in err and err.count("\n") == 1


def test_every_model_command_takes_the_store_names(capsys, ollama_store, tmp_path, tiny_llama):
    code, by_name, err = run(capsys, "tokenize", "--model", "ollama:tiny", "--text", "the cat")
    assert code == 0 and by_name == run(capsys, "tokenize", "--model", tiny_llama, "--text", "the cat")[1]
    code, out, err = run(capsys, "generate", "--model", "ollama:tiny", "--prompt", "the",
                         "--max-new-tokens", "3")
    assert code == 0 and out == run(capsys, "generate", "--model", tiny_llama, "--prompt", "the",
                                    "--max-new-tokens", "3")[1]


def test_run_yaml_repeats_a_run_by_its_ollama_name(capsys, ollama_store, chat_data, tmp_path, tiny_llama):
    """The run keeps ``ollama:tiny:1b`` (not the blob path): ``--config run.yaml`` resolves it
    again and repeats the run bit for bit, as the same run from the file path does."""
    first = json.loads(_train(capsys, "ollama:tiny:1b", chat_data, tmp_path / "a")[1].splitlines()[-1])
    code, out, err = run(capsys, "finetune", "--config", tmp_path / "a" / "run.yaml",
                         "--out", tmp_path / "b", "--quiet")
    assert code == 0, err
    again = json.loads(out.splitlines()[-1])
    by_path = json.loads(_train(capsys, tiny_llama, chat_data, tmp_path / "c")[1].splitlines()[-1])
    assert first["last_loss"] == again["last_loss"] == by_path["last_loss"]
    assert "model: ollama:tiny:1b\n" in (tmp_path / "b" / "run.yaml").read_text()


def _source(path, **kw):
    return stores.Source(path=Path(path), spec="ollama:tiny:1b", store="ollama",
                         ollama_name="tiny:1b", **kw)


def test_the_modelfile_says_which_template_the_adapter_learned(tiny_llama, tmp_path):
    from toygraph.adapters.modelfile import OLLAMA_CHATML, modelfile_text
    from toygraph.fixtures.tiny_models import write_tiny_llama
    same = modelfile_text(tiny_llama, source=_source(tiny_llama, template=OLLAMA_CHATML))
    assert "the Ollama model's own template layer is the same text" in same
    assert f'TEMPLATE """{OLLAMA_CHATML}"""' in same
    # a template we have no Go form of: Ollama keeps the model's own, and the file says so
    llama2 = write_tiny_llama(tmp_path / "l2.gguf", chat_template=(
        "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"))
    text = modelfile_text(llama2, source=_source(llama2, template="{{ .Prompt }}"))
    assert "TEMPLATE" not in [line.split(" ")[0] for line in text.splitlines()]
    assert "No TEMPLATE: Ollama keeps tiny:1b's own Go template (through FROM)" in text
    # the run's --template with no Go form, over an Ollama model: the mismatch is named
    text = modelfile_text(llama2, template=("chatml-x", "{{ messages[0]['content'] }}"),
                          source=_source(llama2, template="{{ .Prompt }}"))
    assert "which is not the one the adapter was trained with" in text


def test_values_a_modelfile_cannot_quote_are_left_out_and_said(tiny_llama):
    from toygraph.adapters.modelfile import modelfile_text
    text = modelfile_text(tiny_llama, source=_source(
        tiny_llama, system='ends in a quote"', params={"stop": ['a"b', "</s>"], "mirostat": 2,
                                                        "penalize_newline": True}))
    lines = text.splitlines()
    assert 'PARAMETER stop "</s>"' in lines and "PARAMETER mirostat 2" in lines
    assert "PARAMETER penalize_newline true" in lines
    assert "# left out (values a Modelfile cannot quote): stop" in lines
    assert "SYSTEM" not in [line.split(" ")[0] for line in lines]
    assert "# The Ollama model's system message cannot be quoted here; Ollama keeps it through FROM." in lines
