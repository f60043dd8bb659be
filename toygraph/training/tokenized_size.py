"""How much memory the tokenized data will take, said before tokenizing a large file.

Tokenizing keeps every row's token ids and target mask (numpy arrays: 5 bytes a token and
~250 bytes a row), so a 600k-row file can take GBs and minutes before step 1. For a file of
``ESTIMATE_FROM_ROWS`` rows or more we tokenize an evenly spaced sample first, measure what
its items occupy (``deep_size``: the objects themselves, not a per-token constant) and
scale by the row count; the estimate goes into the "tokenizing ..." line, and one that
exceeds the memory the machine has available is refused in one line before the work.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from toygraph.core.base_memory import available_bytes
from toygraph.errors import DataError

#: Files with fewer rows are tokenized without an estimate (they fit anywhere).
ESTIMATE_FROM_ROWS = 1000
#: Rows tokenized to make the estimate, spread evenly over the file.
SAMPLE_ROWS = 64


def deep_size(obj, seen: set) -> int:
    """Bytes ``obj`` holds: itself and everything it references that ``seen`` has not
    counted (shared objects such as the small ints and True/False count once)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, np.ndarray):
        return size if obj.base is None else size + obj.nbytes
    if isinstance(obj, dict):
        return size + sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return size + sum(deep_size(x, seen) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return size + sum(deep_size(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if hasattr(obj, "__dict__"):
        return size + deep_size(vars(obj), seen)
    return size


def estimate_tokenized_bytes(encode, rows: list) -> int | None:
    """The bytes ``encode(rows)`` (a recipe's ``encode_data`` with the tokenizer bound)
    will hold, from a sample of ``SAMPLE_ROWS`` rows; None for a small file, or when the
    sample does not encode (the real pass then reports the row)."""
    if len(rows) < ESTIMATE_FROM_ROWS:
        return None
    sample = rows[::len(rows) // SAMPLE_ROWS][:SAMPLE_ROWS]
    try:
        items = encode(sample).items
    except DataError:
        return None
    seen: set = set()
    return int(sum(deep_size(item, seen) for item in items) * len(rows) / len(sample))


def check_tokenized_memory(estimate: int | None, what: str, rows: int, size_text) -> str:
    """The estimate as text for the tokenizing line ('' when there is none); an estimate
    above the memory available is a DataError naming the numbers and the way out."""
    if estimate is None:
        return ""
    free = available_bytes()
    if free is not None and estimate > free:
        raise DataError(f"{what}: tokenizing {rows:,} rows needs about {size_text(estimate)} "
                        f"of memory (estimated from {SAMPLE_ROWS} rows) and this machine has "
                        f"{size_text(free)} available; use --max-examples or a smaller file")
    return f"; about {size_text(estimate)} in memory, estimated from {SAMPLE_ROWS} rows"
