"""Several data files mixed by weight: ``--data a.jsonl:0.7 --data b.jsonl:0.3``.

What a mix means:

- Each file is read, encoded and split into training and validation rows on its own, so
  a row its weight repeats never lands on both sides.
- The training set has as many rows as the files' training rows together (N = sum of
  n_i). File i gives round(share_i * N) of them, share_i = w_i / sum(w) (at least one
  row): when that is no more than it has, a sample without replacement; when it is more,
  every row as often as it fits whole and a sample for the remainder. Weights are
  relative (0.7/0.3 and 7/3 mix alike). Without weights (``--data a --data b``) the files
  are concatenated: each file's share is its size.
- The mix is drawn once, from ``--seed``: the same rows every epoch (the batches then
  shuffle them per epoch, toygraph.data.batches), and the same rows again when a run
  resumes, so resuming stays bit-exact. (A down-weighted file thus shows the same subset
  each epoch; raise its weight or --epochs rather than expect fresh rows.)
- Validation is every file's held-out rows, unweighted: the loss per token over them.

One file is taken whole, as it always was, whatever weight it is given.

>>> spec = parse_data_spec("a.jsonl:0.7")           # doctest: +SKIP
>>> train = mix_rows([rows_a, rows_b], [0.7, 0.3], seed=0)   # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toygraph.errors import DataError

__all__ = ["DataSpec", "parse_data_spec", "parse_data_specs", "mix_counts", "mix_shares", "mix_rows",
           "mix_hash", "mix_summary"]


@dataclass(frozen=True)
class DataSpec:
    """One ``--data`` value: a file and its weight (None: not given)."""
    path: str
    weight: float | None = None

    @property
    def name(self) -> str:
        return Path(self.path).name


def parse_data_spec(spec: str) -> DataSpec:
    """``PATH`` or ``PATH:WEIGHT``. A path that exists as a file is taken whole even when it
    holds a ':'; a weight must be a finite number > 0."""
    if Path(spec).is_file() or ":" not in spec:
        return DataSpec(spec)
    path, _, weight = spec.rpartition(":")
    try:
        value = float(weight)
    except ValueError:
        return DataSpec(spec)   # not a weight: a path with ':' (reported missing when read)
    if not (math.isfinite(value) and value > 0):
        raise DataError(f"--data {spec}: the weight must be a finite number > 0, got {weight}")
    return DataSpec(path, value)


def parse_data_specs(specs) -> list[DataSpec]:
    """Every ``--data`` value; weights given to all files or to none (one file may take one)."""
    if isinstance(specs, str):
        specs = [specs]
    out = [parse_data_spec(s) for s in specs]
    if not out:
        raise DataError("--data: no data file given")
    weighted = [s.weight is not None for s in out]
    if len(out) > 1 and any(weighted) and not all(weighted):
        bare = next(s.path for s in out if s.weight is None)
        raise DataError(f"--data {bare}: give every file a weight (PATH:WEIGHT) or none")
    paths = [str(Path(s.path).resolve()) for s in out]
    if len(set(paths)) != len(paths):
        raise DataError("--data: a file is given twice; give it one weight instead")
    return out


def mix_counts(sizes: list[int], weights: list[float] | None) -> list[int]:
    """How many training rows each file gives: its size without weights, else
    round(share * total) and at least 1."""
    if weights is None:
        return list(sizes)
    total = sum(sizes)
    return [max(1, round(share * total)) for share in mix_shares(weights)]


def mix_shares(weights: list[float]) -> list[float]:
    """Each weight's share of their sum. When that sum overflows (finite weights as large
    as 1e308), divided by the largest weight first, so they keep their proportions."""
    total = sum(weights)
    if math.isfinite(total):
        return [w / total for w in weights]
    top = max(weights)
    scaled = [w / top for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


def mix_rows(parts: list[list], weights: list[float] | None, seed: int) -> list:
    """The training rows of a mix (see the module docstring): file by file, each file's
    rows in its sampled order. A pure function of the parts, weights and seed."""
    out = []
    for i, (rows, count) in enumerate(zip(parts, mix_counts([len(p) for p in parts], weights))):
        n = len(rows)
        if n == 0:
            continue
        rng = np.random.default_rng([seed, 0x6D6978, i])   # "mix": apart from the batch order
        whole, rest = divmod(count, n)
        order = [k for _ in range(whole) for k in range(n)]
        order += sorted(rng.permutation(n)[:rest].tolist())
        out += [rows[k] for k in order]
    return out


def mix_hash(specs: list[DataSpec], file_hashes: list[str]) -> str:
    """What a checkpoint compares for a mix: every file's content and weight."""
    doc = [[h, s.weight] for s, h in zip(specs, file_hashes)]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def mix_summary(specs: list[DataSpec], sizes: list[int], seed: int) -> tuple[str, list[dict]]:
    """The data line a mixed run prints (each file's share of the training rows) and the
    same as records for ``run_start``."""
    weights = [s.weight for s in specs] if specs[0].weight is not None else None
    counts = mix_counts(sizes, weights)
    total = sum(counts)
    shares = mix_shares(weights) if weights else [c / total for c in counts]
    records, parts = [], []
    for spec, n, count, share in zip(specs, sizes, counts, shares):
        how = ("all" if count == n else f"{count / n:.2f}x" if count > n
               else f"a sample of {count}")
        parts.append(f"{spec.name} {share:.0%} ({count} rows: {how} of its {n})")
        records.append({"path": spec.path, "weight": spec.weight, "share": share,
                        "train_rows": n, "mixed_rows": count})
    line = (f"data mix of {len(specs)} files, {total} training rows (drawn once, --seed "
            f"{seed}): " + "; ".join(parts))
    return line, records
