"""Parquet, CSV and Arrow data files, read through the ``datasets`` library where it is
installed (an optional extra: JSONL needs nothing). Each table row is one JSON-like row of
the shapes toygraph/data/examples.py accepts; errors name ``file:ROW`` (1-based, the row
number where a JSONL file has its line number).

``datasets`` gives every row of a column the same type: a struct's fields are the union of
the rows' fields, a missing one None. So in Parquet write tool-call ``arguments`` as JSON
strings (as the Hugging Face datasets with tool calls do) rather than objects, whose keys
would be unified across rows. A CSV cell is text: CSV suits the flat shapes (text,
instruction/response, prompt/completion strings).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from toygraph.bounded import regular_file_error
from toygraph.errors import DataError

#: The file endings read as tables, and the ``datasets`` builder of each.
TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def is_table(path) -> bool:
    return Path(path).suffix.lower() in TABLE_FORMATS


def load_table(path, parse_row) -> list:
    """Every row of a Parquet/CSV/Arrow file through ``parse_row(obj, where, row, path)``
    (the JSONL parser's), via ``datasets``, converted from the file's bytes on every read."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: data file not found")
    if not p.is_file():   # a directory, or a FIFO or device that would block
        raise DataError(f"{p}: {regular_file_error(p)}")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{p}: reading {p.suffix} files needs the datasets package "
                        f"(pip install datasets), or convert it to JSONL") from None
    # datasets' cache knows a file by its path and mtime: a file rewritten with its mtime
    # kept would be read stale while the checkpoint's data_hash records the new bytes. So
    # each read converts the file anew, into a cache of its own that goes with the read.
    with tempfile.TemporaryDirectory(prefix="toygraph-table-") as cache:
        try:
            table = datasets.load_dataset(TABLE_FORMATS[p.suffix.lower()], data_files=str(p),
                                          split="train", cache_dir=cache)
        except Exception as e:   # the library's own error for a broken file: one line, named
            reason = " ".join(str(e).split()) or type(e).__name__
            raise DataError(f"{p}: cannot read it as {p.suffix[1:]}: {reason}") from None
        rows = [parse_row(_drop_none(obj), f"{p}:{n}", n, str(p))
                for n, obj in enumerate(table, start=1)]
        del table
    if not rows:
        raise DataError(f"{p}: no examples (the table has no rows)")
    return rows


def _drop_none(obj: dict) -> dict:
    """A row without the columns it leaves empty (None), as a JSONL row would lack them,
    so that e.g. a "system" column empty in this row is no system prompt."""
    return {k: v for k, v in obj.items() if v is not None}
