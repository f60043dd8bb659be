"""The suite never writes outside temporary folders (issue 47 item 4): it runs with a home
and caches of its own (support/isolation.py, set up by conftest.py), and a run that
writes into the user's real toygraph cache fails."""
import os
import tempfile
from pathlib import Path

from support.isolation import changes, snapshot
from toygraph import environment


def test_the_suite_runs_in_a_private_home_and_cache(pytestconfig):
    home = pytestconfig._toygraph_home
    tmp = Path(tempfile.gettempdir()).resolve()
    for path in (Path.home(), environment.cache_dir("models"), Path(os.environ["XDG_CACHE_HOME"])):
        assert tmp in path.resolve().parents, path
    assert Path.home() != home.real_home
    assert environment.cache_dir("models").parent != home.real_cache
    # where a tool writes by default (pip's cache, ~/.cache/...) is the private home too
    assert Path(os.path.expanduser("~/.cache")).resolve().is_relative_to(home.root.resolve())


def test_a_write_into_the_watched_cache_is_seen(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "kept.gguf").write_bytes(b"GGUF")
    before = snapshot(tmp_path)
    (tmp_path / "models" / "new.gguf").write_bytes(b"GGUF")
    (tmp_path / "models" / "kept.gguf").write_bytes(b"GGUF and more")
    assert changes(before, snapshot(tmp_path)) == ["+ models/new.gguf", "~ models/kept.gguf"]
    assert changes(before, before) == []
