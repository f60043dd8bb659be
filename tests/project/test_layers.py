"""The package's layers: one import direction, no cycles, no test fixtures in production.

Every import counts, whether at the top of a module or inside a function (a lazy import
is still a dependency, and a cycle through one is still a cycle). A module belongs to the
layer of the longest prefix in ``LAYERS`` that names it; it may import from its own layer
and the layers below, never from one above. docs/design.md draws the same picture.
"""
from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Where each installed package's sources are (recipes/ and fixtures/ install inside
#: the toygraph namespace).
SOURCES = {"toygraph": ROOT / "toygraph", "toygraph.recipes": ROOT / "recipes",
           "toygraph.fixtures": ROOT / "fixtures"}

#: Lowest first. The op families' definitions and numpy kernels (toygraph/ops/<family>/
#: __init__.py and numpy.py) are the vocabulary the graph core builds, differentiates and
#: runs graphs with, so they sit below it; their CUDA halves (cuda.py, and the lowering API
#: they are written against) sit above the core and below the CUDA runtime (driver, NVRTC,
#: the backend, the host device), which loads them and registers itself as a backend the
#: session finds by name (core/backends.py): the core imports no backend. A prefix may name
#: a family folder with ``*``.
LAYERS = [
    ("foundation", ("toygraph", "toygraph.errors", "toygraph.environment", "toygraph.atomic",
                    "toygraph.bounded", "toygraph.limits", "toygraph.precision",
                    "toygraph.distributed")),
    ("the GGUF file", ("toygraph.gguf",)),
    ("the CPU engine", ("toygraph.cpu",)),
    ("op definitions and numpy kernels", ("toygraph.ops",)),
    ("graph core", ("toygraph.core",)),
    ("CUDA lowering", ("toygraph.ops.lowering", "toygraph.ops.*.cuda", "toygraph.ops.*.cuda_*")),
    ("CUDA runtime", ("toygraph.cuda",)),
    ("models", ("toygraph.models",)),
    ("adapters", ("toygraph.adapters",)),
    ("data", ("toygraph.data",)),
    ("inference", ("toygraph.inference",)),
    ("recipes", ("toygraph.recipes",)),
    ("training runs", ("toygraph.training",)),
    ("demo", ("toygraph.demo",)),
    ("command line", ("toygraph.cli",)),
    ("test fixtures", ("toygraph.fixtures",)),
]
MAX_TOP_LEVEL_MODULES = 10


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if pkg == "toygraph" and rel[0] in ("recipes", "fixtures"):
                continue
            parts = [pkg, *rel]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The toygraph modules ``name`` imports (a package when no module of that name)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known and "." in t:   # `import toygraph.x.y` of a name
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                out.add(t)
    return out


def layer_of(name: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (fnmatch(name, p) or fnmatch(name, p + ".*")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{name} is in no layer: add it to LAYERS"
    return layer


MODULES = modules()
GRAPH = {name: imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_the_walk_sees_the_package():
    assert {"toygraph.core.graph", "toygraph.ops.gemm", "toygraph.ops.gemm.cuda",
            "toygraph.ops.gemm.numpy", "toygraph.cuda.backend",
            "toygraph.recipes.base", "toygraph.fixtures.golden", "toygraph.cli.main"} <= set(MODULES)
    assert "toygraph.core.graph" in GRAPH["toygraph.core.session"]
    assert "toygraph.ops.table" in GRAPH["toygraph.ops.norm"]   # relative or absolute


def test_no_import_cycles():
    """Tarjan's strongly connected components: any with two or more modules is a cycle."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_every_import_points_down_the_layers():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a in sorted(GRAPH) for b in sorted(GRAPH[a])
              if layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_production_code_never_imports_the_test_fixtures():
    wrong = [(a, b) for a in GRAPH if not a.startswith("toygraph.fixtures")
             for b in GRAPH[a] if b.startswith("toygraph.fixtures")]
    assert not wrong, wrong


def test_the_top_level_stays_small():
    top = sorted(p.name for p in (ROOT / "toygraph").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


@pytest.mark.parametrize("name", ["toygraph.core.session", "toygraph.ops.norm",
                                  "toygraph.ops.norm.cuda"])
def test_a_planted_upward_import_would_be_caught(name, tmp_path):
    """The layer check can fail: the same walk over a copy of a core module that imports
    the training loop reports it."""
    fake = tmp_path / "m.py"
    fake.write_text(MODULES[name].read_text() + "\nfrom toygraph.training.loop import Trainer\n")
    got = imports(name, fake, set(MODULES))
    assert "toygraph.training.loop" in got and layer_of("toygraph.training.loop") > layer_of(name)


def test_the_core_reaches_no_backend():
    """Nothing the graph core imports, directly or through the op families, is CUDA: the
    families' cuda.py halves and the lowering API are loaded by the CUDA runtime alone."""
    seen, todo = set(), [m for m in GRAPH if m.startswith("toygraph.core")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH[m]
    cuda = sorted(m for m in seen if layer_of(m) >= layer_of("toygraph.ops.lowering"))
    assert not cuda, cuda
    assert layer_of("toygraph.ops.norm.numpy") < layer_of("toygraph.core.graph") \
        < layer_of("toygraph.ops.norm.cuda") == layer_of("toygraph.ops.gemm.cuda_tc") \
        < layer_of("toygraph.cuda.backend")
