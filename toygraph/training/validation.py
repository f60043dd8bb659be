"""A finished run's examples, rebuilt from its run directory: the rows its ``run.yaml``
names, tokenized with the tokenizer given (the adapter's template) and split as
``prepare`` split them (same --val-split, --seed, --max-examples, --seq-len).

>>> seqs, masks = run_validation("runs/x", lm.tokenizer)          # doctest: +SKIP
>>> seqs, masks, what = run_sample("runs/x", lm.tokenizer, 16)    # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path

from toygraph.data.batches import split_train_val
from toygraph.data.mixing import parse_data_specs
from toygraph.errors import DataError
from toygraph.files import check_regular_file
from toygraph.recipes import recipe_class
from toygraph.training.run_config import RunConfig
from toygraph.training.run_file import RUN_FILE, load_run_file


def _run_split(run_dir, tokenizer):
    """(run file, run config, training items, validation items, whether they are pairs)
    of the run in ``run_dir``, each list in prepare's order (a mix's files one after
    another); a preference run's (DPO, ORPO) pairs as their chosen sequences, the reply
    the adapter was trained to prefer as the targets."""
    run_file = Path(run_dir) / RUN_FILE
    if not run_file.is_file():
        raise DataError(f"{run_dir}: no {RUN_FILE} (not a run directory); give --data")
    run_cfg = RunConfig.from_options(load_run_file(run_file))
    cls = recipe_class(run_cfg.recipe)
    train, val = [], []
    for spec in parse_data_specs(run_cfg.data):
        check_regular_file(spec.path, f"{run_file}: data", DataError)
        rows = cls.load_data(spec.path)
        rows = rows[:run_cfg.max_examples] if run_cfg.max_examples else rows
        items = cls.encode_data(rows, tokenizer, run_cfg.seq_len).items
        t, v = split_train_val(items, run_cfg.val_split, run_cfg.seed)
        train, val = train + t, val + v
    pairs = isinstance((val or train or [None])[0], tuple)
    if pairs:   # preference pairs: their chosen sequences
        train, val = [pair[0] for pair in train], [pair[0] for pair in val]
    if not hasattr((val or train or [None])[0], "target_mask"):
        raise DataError(f"{run_file}: the {run_cfg.recipe} run's examples are not token "
                        "sequences with targets; give --data")
    return run_file, run_cfg, train, val, pairs


def _as_lists(items) -> tuple[list[list[int]], list[list[bool]]]:
    return [list(e.tokens) for e in items], [list(e.target_mask) for e in items]


def run_validation(run_dir, tokenizer) -> tuple[list[list[int]], list[list[bool]]]:
    """(token ids, target masks) of the validation examples of the run in ``run_dir``.
    A one-line DataError when the directory holds no run file, the run had no
    validation split, or its recipe's examples are not token sequences with targets."""
    run_file, _, _, val, _ = _run_split(run_dir, tokenizer)
    if not val:
        raise DataError(f"{run_file}: the run had no validation split (val_split 0); give --data")
    return _as_lists(val)


def run_sample(run_dir, tokenizer, n: int) -> tuple[list, list, str]:
    """The first ``n`` validation examples of the run (its training examples when it had
    no validation split): (token ids, target masks, what they are, in words)."""
    _, _, train, val, pairs = _run_split(run_dir, tokenizer)
    items, what = (val, "validation") if val else (train, "training")
    rows = f"{what} pairs' chosen replies" if pairs else f"{what} rows"
    return (*_as_lists(items[:n]), f"{min(n, len(items))} of the run's {len(items)} {rows}")


#: Validation rows the line at the end of a run evaluates (``--fidelity``).
END_ROWS = 8


def end_of_run_fidelity(run_cfg, prep, out) -> str | None:
    """The line a LoRA run with a validation split ends with: ``--fidelity``'s verdict on
    the first END_ROWS validation rows of the adapter just written to ``out``; None when
    there is nothing to say (off, no validation rows, not token sequences)."""
    from toygraph.inference.fidelity import fidelity_report
    quants = [t for t in run_cfg.fidelity if t != "none"]
    rows = [e for e in prep.val[:END_ROWS] if hasattr(e, "target_mask")]
    if not quants or not rows:
        return None
    report = fidelity_report(prep.model.path, out, [e.tokens for e in rows],
                             [e.target_mask for e in rows], quants=quants, merged_types=(),
                             backend=run_cfg.backend, precision=run_cfg.precision)
    return (f"fidelity on {len(rows)} validation rows (toygraph eval --quants for all "
            f"{len(prep.val)}): {report.verdict()}")
