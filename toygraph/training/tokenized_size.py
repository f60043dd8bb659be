"""How much memory the data will take, said before tokenizing a large file.

Tokenizing keeps every row's token ids and target mask (numpy arrays: 5 bytes a token and
~250 bytes a row), beside the rows read, so a 600k-row file can take GBs and minutes before
step 1. For a file of ``ESTIMATE_FROM_ROWS`` rows or more we tokenize an evenly spaced
sample first, measure what its items occupy (``deep_size``: the objects themselves, not a
per-token constant) and what the rows read occupy, and scale by the row count; the
estimate goes into the "tokenizing ..." line, and tokens that would not fit in the memory
this process may use (toygraph/limits.py) are refused in one line before the work.

Measured (a one-step SmolLM2 finetune at --seq-len 128, its peak RSS less that of the same
run on 1,000 rows): 10^6 one-line text rows took 665 MiB, estimated 605 MiB; 10^5
instruction rows 89 MiB, estimated 125 MiB.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from toygraph.core.frozen_base import available_bytes
from toygraph.errors import DataError
from toygraph.limits import limit_words

#: Files with fewer rows are tokenized without an estimate (they fit anywhere).
ESTIMATE_FROM_ROWS = 1000
#: Rows tokenized to make the estimate, spread evenly over the file.
SAMPLE_ROWS = 64
#: What an array's own data costs beyond its bytes: the allocator's header and rounding
#: (a row's arrays are a few dozen bytes). Fitted to RSS: tokenizing 10^6 short rows grew
#: the process by 444 MiB (text rows) and 657 MiB (instruction rows) where deep_size
#: without it counted 336 and 517, two arrays a row.
ALLOCATION_BYTES = 64


def deep_size(obj, seen: set) -> int:
    """Bytes ``obj`` holds: itself and everything it references that ``seen`` has not
    counted (shared objects such as the small ints and True/False count once)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, np.ndarray):
        return size + ALLOCATION_BYTES if obj.base is None else size + obj.nbytes
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


def rows_bytes(files: list) -> int | None:
    """What the rows read (each file's list of examples) occupy, from a sample of each file
    of ``ESTIMATE_FROM_ROWS`` rows or more; None when no file is that large."""
    total = None
    for rows in files:
        if len(rows) >= ESTIMATE_FROM_ROWS:
            sample = rows[::len(rows) // SAMPLE_ROWS][:SAMPLE_ROWS]
            total = (total or 0) + int(deep_size(sample, set()) * len(rows) / len(sample))
    return total


def check_tokenized_memory(estimate: int | None, what: str, rows: int, size_text,
                           held: int | None = None) -> str:
    """The estimate as text for the tokenizing line ('' when there is none), with ``held``
    (:func:`rows_bytes`, already in memory) added to say what the data takes; tokens above
    the memory available are a DataError naming the numbers and the way out."""
    if estimate is None:
        return ""
    free = available_bytes()
    if free is not None and estimate > free:
        raise DataError(f"{what}: tokenizing {rows:,} rows needs about {size_text(estimate)} "
                        f"of memory (estimated from {SAMPLE_ROWS} rows) and this process has "
                        f"{size_text(free)} available{limit_words()}; use --max-examples or a smaller file")
    if held:
        return (f"; the data takes about {size_text(estimate + held)} in memory, "
                f"{size_text(estimate)} of it tokens, estimated from {SAMPLE_ROWS} rows")
    return f"; about {size_text(estimate)} in memory, estimated from {SAMPLE_ROWS} rows"
