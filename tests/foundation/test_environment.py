"""toygraph/environment.py: the environment table, its typed accessors and errors, the cache
layout, docs/settings.md's copy of the table, and the warning when graph capture falls back."""
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from toygraph import ops
from toygraph import environment
from toygraph.errors import CudaError, SettingError
from toygraph.models import catalog

SETTINGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_defaults_and_typed_values(monkeypatch):
    for name in environment.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert environment.get("TOYGRAPH_CUDA_GRAPHS") is True
    assert environment.get("TOYGRAPH_OFFLINE") is False
    assert environment.get("TOYGRAPH_CUDA_DEVICE") == 0
    assert environment.get("TOYGRAPH_SMOLLM2") is None
    assert environment.get("TOYGRAPH_CACHE") == Path.home() / ".cache" / "toygraph"
    assert environment.get("TOYGRAPH_HOST_SCHEDULE") == "forward"
    monkeypatch.setenv("TOYGRAPH_CUDA_GRAPHS", "0")       # read at call time, not import
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    monkeypatch.setenv("TOYGRAPH_HOST_OPT", "-O2")
    monkeypatch.setenv("TOYGRAPH_OFFLINE", "yes")
    monkeypatch.setenv("TOYGRAPH_SMOLLM2", "~/m.gguf")
    assert environment.get("TOYGRAPH_CUDA_GRAPHS") is False
    assert environment.get("TOYGRAPH_CUDA_DEVICE") == "host"
    assert environment.get("TOYGRAPH_HOST_OPT") == "-O2"
    assert environment.get("TOYGRAPH_OFFLINE") is True
    assert environment.get("TOYGRAPH_SMOLLM2") == Path.home() / "m.gguf"
    monkeypatch.setenv("TOYGRAPH_CUDA_GRAPHS", "")          # empty means the default
    assert environment.get("TOYGRAPH_CUDA_GRAPHS") is True


@pytest.mark.parametrize("name, value, message", [
    ("TOYGRAPH_CUDA_GRAPHS", "maybe", "TOYGRAPH_CUDA_GRAPHS must be 0 or 1 .*got 'maybe'"),
    ("TOYGRAPH_CUDA_QMATMUL", "2", "TOYGRAPH_CUDA_QMATMUL must be 0 or 1 .*got '2'"),
    ("TOYGRAPH_CUDA_DEVICE", "gpu0", "TOYGRAPH_CUDA_DEVICE must be a device ordinal or 'host', "
                                     "got 'gpu0'"),
    ("TOYGRAPH_HOST_SCHEDULE", "random", "TOYGRAPH_HOST_SCHEDULE must be one of forward, "
                                         "reverse, got 'random'"),
    ("TOYGRAPH_HOST_OPT", "-Ofast", "TOYGRAPH_HOST_OPT must be one of -O0, -O1, -O2, -O3"),
])
def test_malformed_value_is_a_one_line_error(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=message) as e:
        environment.get(name)
    assert "\n" not in str(e.value)


def test_readers_go_through_the_table(monkeypatch):
    """The package's readers raise the table's error for a malformed value."""
    from toygraph.cuda import backend, devmem
    from toygraph.cuda.host import device
    monkeypatch.setenv("TOYGRAPH_CUDA_QMATMUL", "maybe")
    with pytest.raises(SettingError, match="TOYGRAPH_CUDA_QMATMUL"):
        devmem.qmatmul_enabled()
    monkeypatch.setenv("TOYGRAPH_HOST_SCHEDULE", "sideways")
    with pytest.raises(SettingError, match="TOYGRAPH_HOST_SCHEDULE"):
        device.schedule()
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "cuda:0")
    with pytest.raises(SettingError, match="TOYGRAPH_CUDA_DEVICE"):
        backend.open_device()
    with pytest.raises(KeyError):
        environment.get("TOYGRAPH_NOT_A_SETTING")


def test_one_cache_root_with_named_folders(monkeypatch, tmp_path):
    from toygraph.cuda import nvrtc
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path))
    assert nvrtc.cache_dir() == tmp_path / "kernels"
    assert catalog.cache_dir() == tmp_path / "models"
    assert environment.cache_dir("bench") == tmp_path / "bench"
    with pytest.raises(KeyError):
        environment.cache_dir("cubin")


def test_smollm2_found_in_models_folder_and_where_earlier_versions_cached_it(monkeypatch,
                                                                            tmp_path):
    monkeypatch.delenv("TOYGRAPH_SMOLLM2", raising=False)
    monkeypatch.setattr(catalog, "_installed_copy", lambda: None)
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path))
    assert catalog.find_smollm2() is None
    legacy = tmp_path / catalog.GGUF_NAME          # the cache root, as before models/
    legacy.write_bytes(b"GGUF")
    assert catalog.find_smollm2() == legacy
    (tmp_path / "models").mkdir()
    moved = shutil.copy(legacy, tmp_path / "models" / catalog.GGUF_NAME)
    assert catalog.find_smollm2() == Path(moved)
    monkeypatch.setenv("TOYGRAPH_SMOLLM2", str(tmp_path / "elsewhere.gguf"))
    assert catalog.find_smollm2() is None           # an explicit path that is missing


def test_the_documented_settings_table_is_the_rendered_table():
    section = SETTINGS_DOC.read_text()
    table = "".join(line + "\n" for line in section.splitlines() if line.startswith("|"))
    assert table == environment.markdown_table()
    assert table.count("\n") == len(environment.SETTINGS) + 2


def test_failed_graph_capture_warns_and_falls_back_to_eager(monkeypatch, caplog):
    """On the host executor (which captures launch lists like a CUDA graph): a capture that
    fails logs a warning on the "toygraph" logger and the phase still runs, eagerly."""
    from toygraph.cuda.host.device import HostContext
    from toygraph.core.graph import Graph
    from toygraph.core.session import Session
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    monkeypatch.setenv("TOYGRAPH_CUDA_GRAPHS", "1")

    def refuse(self, record_launches):
        raise CudaError("cuStreamBeginCapture failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    monkeypatch.setattr(HostContext, "capture", refuse)
    g = Graph()
    x = g.input("x", (3, 5))
    y = g.output(ops.mul(x, x))
    s = Session(g, backend="cuda")
    s.realize()
    s.reset()
    data = np.arange(15, dtype=np.float32).reshape(3, 5)
    s.upload(x, data)
    caplog.clear()   # what the run logs: not a one-time line of the kernel library's build
    with caplog.at_level(logging.WARNING, logger="toygraph"):
        s.run("forward")
    warned = [r for r in caplog.records if r.name.startswith("toygraph")
              and r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].name == "toygraph.cuda.backend"
    assert re.search(r"graph capture of a \d+-node phase failed", warned[0].getMessage())
    assert "launching its kernels one by one" in warned[0].getMessage()
    np.testing.assert_array_equal(s.download(y), data * data)
