"""Comments, docstrings and docs name today's files: none names a module of toygraph 0.1
(ops.py, hostdev.py, quant.py, trainer.py, ... before 0.2 sorted them into sub-packages),
and a path into our own folders names a file that exists."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Modules of toygraph 0.1 that no longer exist under these names (0.2's move, and the
#: CUDA kernels' old homes). None is a file name in the tree today (checked below), so any
#: mention is a leftover.
OLD_NAMES = {
    "ops.py", "hostdev.py", "hostexec.py", "hostcc.py", "trainer.py", "train.py", "adapters.py",
    "kernels.py", "quant.py", "quant_encode.py", "settings.py", "gguf_reader.py", "optim.py",
    "checkpoint.py", "runs.py", "data.py", "attention.cu", "moved.py",
}
#: Our folders: a path starting with one of them must name a file of the tree.
OUR_FOLDERS = {"toygraph", "core", "ops", "cuda", "host", "lowering", "include", "gguf", "models",
               "adapters", "data", "inference", "training", "cli", "demo", "recipes", "fixtures",
               "tests", "support", "bench", "kernels", "cpu"}
#: Leftovers in files another change is rewriting (models/: issue 40 item 1; the CPU
#: benches: the lead's CPU engine): the name each still holds. The test fails once the file
#: no longer holds it, so the entry goes with it.
PENDING: dict[str, str] = {}
TEXT = (".py", ".md", ".sh", ".cu", ".cuh", ".h", ".cpp", ".toml")
TOKEN = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*[\w-]+\.(?:py|cu|cuh|cpp|h|sh|md))\b")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split() if out.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".venv" not in p.parts]
    return [f for f in files if (ROOT / f).is_file()]


FILES = tracked()


def exists(path: str) -> bool:
    return any(f == path or f.endswith("/" + path) for f in FILES)


def stale(token: str) -> bool:
    if exists(token):
        return False
    return token.rsplit("/", 1)[-1] in OLD_NAMES or token.split("/")[0] in OUR_FOLDERS


def test_no_old_name_is_a_file_today():
    assert not [f for f in FILES if f.rsplit("/", 1)[-1] in OLD_NAMES]


def test_comments_and_docs_name_todays_files():
    """Production code, tests, bench tools and docs (bench/results/ are dated records of
    their day and keep its names; this file lists the old names)."""
    found = []
    for f in FILES:
        if not f.endswith(TEXT) or f.startswith("bench/results/") or f == "tests/project/test_file_names.py":
            continue
        for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            for token in TOKEN.findall(line):
                if stale(token) and PENDING.get(f) != token:
                    found.append(f"{f}:{i}: {token}")
    assert not found, "names of files that do not exist:\n" + "\n".join(found)


def test_pending_leftovers_are_still_there():
    for f, token in PENDING.items():
        assert token in TOKEN.findall((ROOT / f).read_text()), f"{f} no longer names {token}: " \
                                                                 "drop it from PENDING"


def test_a_planted_leftover_is_caught():
    assert stale("hostexec.py") and stale("toygraph/cuda/constants.py") and stale("core/ops.py")
    assert not stale("tests/ops/test_ops.py") and not stale("ops/lowering/constants.py")
    assert TOKEN.findall("see quant.py's decoder and tests/ops/test_ops.py") == \
        ["quant.py", "tests/ops/test_ops.py"]
