"""bench/engine_ab.py: the other revision's engine source, assembled by that revision."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import engine_ab  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _git_ok() -> bool:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                              capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout: no revision to build from")
def test_the_source_at_a_revision_is_that_revisions_engine():
    text = engine_ab.source_at("HEAD")
    committed = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:toygraph/cpu/pool.h"],
                               capture_output=True, text=True, check=True).stdout
    assert committed in text and "TG_REPLAY_KERNEL(matmul_blocks)" in text


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout: no revision to build from")
def test_an_unknown_revision_is_one_clear_line():
    with pytest.raises(SystemExit, match="--against no-such-rev"):
        engine_ab.source_at("no-such-rev")
