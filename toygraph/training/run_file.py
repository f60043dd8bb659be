"""The run file: the YAML form of a RunConfig (``--config run.yaml``, and the ``run.yaml``
every run directory keeps, which repeats the run), and the settings block a run prints
when it starts.

>>> write_run_file(run_cfg, "runs/x")                          # doctest: +SKIP
>>> load_run_file("runs/x/run.yaml")["rank"]                  # doctest: +SKIP
8
"""
from __future__ import annotations

import difflib
import os
from dataclasses import MISSING
from pathlib import Path

from toygraph.atomic import atomic_write
from toygraph.bounded import excerpt, load_yaml
from toygraph.errors import ToygraphError
from toygraph.models.stores import store_of
from toygraph.training.run_config import GROUPS, RunConfig, check_value, differs, coerce

#: The run file a run directory keeps (and ``--config`` reads).
RUN_FILE = "run.yaml"
#: A run file is a page of options; one larger than this is not one.
RUN_FILE_BYTES = 1 << 20


def load_run_file(path) -> dict:
    """The options a YAML run file sets (keys: the field names). A one-line error for a file
    that is missing or not YAML, a key no option has (naming the closest one) or a value
    of the wrong type."""
    p = Path(path)
    # bounded (toygraph/bounded.py): a regular file of at most 1 MiB, nesting and alias
    # expansion limited, so /dev/zero or a billion-laughs file is refused at once
    doc = load_yaml(p, f"--config {p}", max_bytes=RUN_FILE_BYTES, error=ToygraphError)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ToygraphError(f"--config {p}: expected a mapping of option: value, found "
                            f"{type(doc).__name__}")
    out = {}
    for key, value in doc.items():
        name = str(key).replace("-", "_")
        if name not in RunConfig.names():
            close = difflib.get_close_matches(name, RunConfig.names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ToygraphError(f"{p}: unknown option {excerpt(key)}{hint}")
        value = coerce(name, value)
        try:
            check_value(name, value)
        except ToygraphError as e:
            raise ToygraphError(f"{p}: {name}: {str(e).split(' ', 1)[1]}") from None
        out[name] = value
    return out


def write_run_file(run_cfg: RunConfig, run_dir) -> Path:
    """``run_dir/run.yaml``: every option that says what the run computes, with the paths
    made absolute, so ``toygraph finetune --config run_dir/run.yaml --out OTHER`` repeats
    the run from any directory. Written atomically."""
    import yaml
    doc = {}
    for name in RunConfig.names():
        if not RunConfig.meta(name)["file"]:
            continue
        value = getattr(run_cfg, name)
        if name == "data":   # PATH or PATH:WEIGHT; abspath keeps the weight suffix
            value = [os.path.abspath(v) for v in value]
        elif name in ("model", "adapter_init", "out") and value and not store_of(value):
            value = os.path.abspath(value)   # a store's name (ollama:...) is kept as it is
        doc[name] = list(value) if isinstance(value, tuple) else value
    path = Path(run_dir) / RUN_FILE
    header = "# The options of this run (toygraph finetune --config this-file --out OTHER repeats it)\n"
    text = header + yaml.safe_dump(doc, sort_keys=False)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def settings_block(run_cfg: RunConfig, width: int = 100) -> str:
    """The effective settings, compact: one line per group, each option ``name value``
    (``*`` marks a value that is not the default); options the recipe does not use and
    the per-invocation ones left at their defaults are left out."""
    lines = [f"settings (* = not the default; all of them in {RUN_FILE} in the run directory):"]
    for group in GROUPS:
        items = []
        for name in RunConfig.names():
            meta = RunConfig.meta(name)
            if meta["group"] != group or not run_cfg.used(name):
                continue
            value, default = getattr(run_cfg, name), RunConfig.default(name)
            changed = default is MISSING or differs(value, default)
            if (not meta["file"] or value is None) and not changed:
                continue   # nothing to say: an unset optional, or a one-invocation flag
            shown = ",".join(value) if isinstance(value, (list, tuple)) else value
            items.append(f"{name} {shown}{'*' if changed and default is not MISSING else ''}")
        if not items:
            continue
        line, out = f"  {group:<11}", []
        for item in items:
            if len(line) + len(item) + 2 > width and line.strip():
                out.append(line.rstrip())
                line = " " * 13
            line += item + "  "
        out.append(line.rstrip())
        lines += out
    return "\n".join(lines)
