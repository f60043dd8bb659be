"""The test suite runs in a home and cache of its own (issue 47 item 4): conftest.py points
``HOME``, ``XDG_CACHE_HOME`` and ``$TOYGRAPH_CACHE`` at a temporary folder before anything
is collected, and checks at the end that the user's real toygraph cache is as it was.

Models already on the machine are still used, read only: each catalog model found in the
real places is handed to the tests by its variable (``TOYGRAPH_SMOLLM2`` ...), and the
compiled engine libraries and kernels and llama.cpp's unpacked converter are copied in, so
nothing is fetched or rebuilt that the user already has. A model that is not there is
fetched into the temporary cache.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

#: The variables that point the suite at its own home and caches.
PRIVATE = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TOYGRAPH_CACHE")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every file under ``root`` by relative path ({} if absent)."""
    if not root.is_dir():
        return {}
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            try:
                st = path.lstat()
            except OSError:   # gone while walking
                continue
            files[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return files


def changes(before: dict, after: dict) -> list[str]:
    """What differs between two snapshots: "+ path" added, "- path" removed, "~ path"
    rewritten."""
    added = [f"+ {p}" for p in sorted(after.keys() - before.keys())]
    removed = [f"- {p}" for p in sorted(before.keys() - after.keys())]
    changed = [f"~ {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return added + removed + changed


class PrivateHome:
    """Move the process into a temporary home (``enter``), remembering the real cache and
    its snapshot; ``leave`` restores the environment and says what changed in the real cache."""

    def enter(self) -> None:
        from toygraph import environment
        from toygraph.models.catalog import CATALOG, GEMMA3_270M, QWEN25_CODER_05B, QWEN25_CODER_15B
        self.saved = {k: os.environ.get(k) for k in (*PRIVATE, "TOYGRAPH_SMOLLM2",
                                                      GEMMA3_270M.env, QWEN25_CODER_05B.env,
                                                      QWEN25_CODER_15B.env)}
        self.real_home = Path.home()
        self.real_cache = environment.cache_dir("models").parent
        # the models this machine has, used in place (read only) before the cache moves
        for env, name in (("TOYGRAPH_SMOLLM2", "smollm2"), (GEMMA3_270M.env, "gemma3-270m"),
                          (QWEN25_CODER_05B.env, "qwen2.5-coder-0.5b"),
                          (QWEN25_CODER_15B.env, "qwen2.5-coder-1.5b")):
            found = CATALOG[name][0]()
            if found is not None and env not in os.environ:
                os.environ[env] = str(found)
        self.before = snapshot(self.real_cache)
        self.root = Path(tempfile.mkdtemp(prefix="toygraph-tests-"))
        cache = self.root / "cache" / "toygraph"
        if (self.real_cache / "kernels").is_dir():   # built libraries: copied, not rebuilt
            shutil.copytree(self.real_cache / "kernels", cache / "kernels", symlinks=True,
                            ignore=shutil.ignore_patterns(".build-*", "*.partial"))
        # llama.cpp's converter, unpacked from its sdist (tests/support/converted.py): a
        # copy of a few MB instead of a download and an unpack of ~80 s
        from support.converted import UNPACKED
        converter = self.real_cache / "models" / UNPACKED
        if (converter / "convert_hf_to_gguf.py").is_file():
            shutil.copytree(converter, cache / "models" / UNPACKED, symlinks=True)
        os.environ.update(HOME=str(self.root / "home"), XDG_CACHE_HOME=str(self.root / "cache"),
                          XDG_CONFIG_HOME=str(self.root / "config"), TOYGRAPH_CACHE=str(cache))
        (self.root / "home").mkdir()

    def leave(self) -> list[str]:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.root, ignore_errors=True)
        return changes(self.before, snapshot(self.real_cache))
