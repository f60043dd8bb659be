"""toygraph/limits.py: the memory this process may use (the machine, ulimit -v, the cgroup),
read by the plan-fits check; a MemoryError anywhere is one line."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from toygraph import limits
from toygraph.cli import main as cli_main
from toygraph.core import frozen_base as base_memory
from toygraph.core.buffer_plan import BufferPlan
from toygraph.gguf.tokenizer import Tokenizer


def _cgroup(tmp_path, version: str, levels: dict[str, tuple[str, int, int]]):
    """A cgroup tree under tmp_path: {relative folder: (limit, usage, inactive file)}, and
    the /proc/self/cgroup naming the deepest one."""
    names = {"v2": ("memory.max", "memory.current", "inactive_file"),
             "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}[version]
    base = tmp_path if version == "v2" else tmp_path / "memory"
    for rel, (limit, used, inactive) in levels.items():
        folder = base / rel
        folder.mkdir(parents=True, exist_ok=True)
        (folder / names[0]).write_text(f"{limit}\n")
        (folder / names[1]).write_text(f"{used}\n")
        (folder / "memory.stat").write_text(f"anon 1\n{names[2]} {inactive}\n")
    deepest = max(levels, key=len)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::/{deepest}\n" if version == "v2" else
                    f"5:devices:/\n4:memory:/{deepest}\n0::/\n")
    return tmp_path, str(proc)


def test_cgroup_v2_limits_are_read_up_the_tree(tmp_path):
    root, proc = _cgroup(tmp_path, "v2", {"": ("max", 0, 0),
                                          "user.slice": (str(8 << 30), 7 << 30, 1 << 30),
                                          "user.slice/job": (str(4 << 30), 1 << 30, 0)})
    left, where = limits.cgroup_left(root, proc)
    # the parent's 8 GiB less its 7 GiB in use (1 GiB of it reclaimable cache) leave 2 GiB,
    # less than the job's own 4 - 1
    assert left == 2 << 30 and where == tmp_path / "user.slice"


def test_cgroup_v1_limits_are_read_and_its_no_limit_is_none(tmp_path):
    root, proc = _cgroup(tmp_path, "v1", {"": (str(9223372036854771712), 5, 0),
                                          "docker/abc": (str(3 << 30), 1 << 30, 0)})
    assert limits.cgroup_left(root, proc) == (2 << 30, tmp_path / "memory/docker/abc")
    root, proc = _cgroup(tmp_path / "n", "v1", {"": (str(9223372036854771712), 5, 0)})
    assert limits.cgroup_left(root, proc) is None


def test_the_least_limit_is_the_one_used_and_named(monkeypatch):
    monkeypatch.setattr(limits, "machine_available", lambda: 64 << 30)
    monkeypatch.setattr(limits, "address_space_left", lambda: 3 << 30)
    monkeypatch.setattr(limits, "cgroup_left", lambda: (5 << 30, "/sys/fs/cgroup/x"))
    assert limits.usable_memory() == (3 << 30, "left under ulimit -v, the address-space limit")
    assert base_memory.available_bytes() == 3 << 30
    plan = BufferPlan(arena_bytes=4 << 30, pinned_bytes=0, offsets={})
    with pytest.raises(Exception, match=r"this process has 3.00 GiB available \(left under "
                                        r"ulimit -v, the address-space limit\)"):
        base_memory.check_fits(plan)


def test_rlimit_as_is_seen_by_the_process_itself():
    """Under ulimit -v the fit check sees the limit (it read only MemAvailable before)."""
    code = textwrap.dedent("""
        import resource
        from toygraph.core.frozen_base import available_bytes
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        print(available_bytes())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert 0 < int(out) < 3 << 30, out


def test_a_memory_error_anywhere_is_one_line_with_what_it_needed(monkeypatch, capsys, tiny_llama):
    def allocate(*args, **kwargs):
        return np.zeros(1 << 62, np.uint8)   # numpy's MemoryError names the size
    monkeypatch.setattr(Tokenizer, "from_gguf", allocate)
    assert cli_main(["tokenize", "--model", str(tiny_llama), "--text", "t"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "out of memory: needs 4.00 EiB" in err and "this process may use" in err, err
