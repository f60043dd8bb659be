"""Fine-tuning data: JSONL examples -> token ids with a target mask -> static-shape batches.

The flow is ``load_examples`` (parse and validate, errors name file:line) ->
``encode_dataset`` (each example through ``toygraph.data.encoding``: render with the model's chat
template, tokenize, mask, truncate) ->
``split_train_val`` -> ``batches`` (one epoch of fixed-shape numpy batches, a pure function
of seed and epoch so a resumed run regenerates the same order).

>>> from toygraph.gguf.tokenizer import Tokenizer                     # doctest: +SKIP
>>> tok = Tokenizer.from_gguf(gguf_path)                          # doctest: +SKIP
>>> ds = encode_dataset(load_examples("capitals.jsonl"), tok, max_len=64)  # doctest: +SKIP
>>> print(ds.report)                                              # doctest: +SKIP
>>> train, val = split_train_val(ds.items, 0.1, seed=0)           # doctest: +SKIP
>>> for b in batches(train, 4, 64, pad_id_for(tok), shuffle=True, seed=0, epoch=0): ...  # doctest: +SKIP

The accepted JSONL shapes and the limits on hostile files are in ``toygraph.data.examples``
(``load_examples`` and ``Example`` are re-exported here, as ``Encoded``, ``encode_rows``
and ``encode_example`` are from ``toygraph.data.encoding``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from toygraph.atomic import file_sha256
from toygraph.data.encoding import Encoded, encode_example, encode_rows
from toygraph.data.examples import Example, load_examples
from toygraph.errors import DataError

__all__ = ["Example", "Encoded", "DataReport", "EncodedDataset", "Batch", "load_examples",
           "encode_rows", "encode_example", "encode_dataset", "check_special_tokens",
           "split_train_val", "pad_id_for", "steps_per_epoch", "EpochBatches", "batches",
           "data_hash"]


@dataclass
class DataReport:
    """What encoding did. ``kept``, ``truncated``, ``dropped`` and the token counts are per
    row; a row is an example, except that each of the ``expanded`` conversations (whose
    chat template is not prefix-consistent, see ``encode_rows``) became ``expanded_rows``
    rows between them, one per assistant turn. ``dropped_lines`` has a line per dropped row."""
    examples: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    target_tokens: int = 0
    total_tokens: int = 0
    max_len: int = 0
    dropped_lines: list[int] = field(default_factory=list)
    expanded: int = 0
    expanded_rows: int = 0

    def __str__(self) -> str:
        rows = (f" -> {self.kept + self.dropped} rows ({self.expanded} multi-turn "
                f"conversation{'s' * (self.expanded != 1)} expanded into {self.expanded_rows}, one "
                f"per assistant turn: the chat template is not prefix-consistent)"
                if self.expanded else "")
        # a row holds max_len inputs (and the one more token its last target is)
        return (f"{self.examples} examples{rows}: {self.kept} kept, {self.truncated} truncated to "
                f"--seq-len {self.max_len}, {self.dropped} dropped (no target token left); "
                f"{self.target_tokens} target tokens of {self.total_tokens}")


@dataclass
class EncodedDataset:
    items: list[Encoded]
    report: DataReport


@dataclass
class Batch:
    """int32 arrays of shape [batch, seq_len]; ``labels[b, i]`` is the token to predict at
    position i, or -1 where ignored (prompt, padding). ``real_tokens`` counts the slots
    that hold an example's token (not padding); ``segments`` is set for packed batches
    (toygraph.data.packing): each slot's example within its row, 0 for padding."""
    tokens: np.ndarray
    positions: np.ndarray
    labels: np.ndarray
    n_targets: int
    real_tokens: int = 0
    segments: np.ndarray | None = None


# ------------------------------------------------------------------------- encoding
def check_special_tokens(tok) -> None:
    """Raise DataError if BOS/EOS written as text do not encode back to their single id:
    the template's <|im_start|>/<|im_end|> would then be split into pieces and the loss mask
    and end-of-turn detection would silently go wrong."""
    for name, tid in (("bos", tok.bos_id), ("eos", tok.eos_id)):
        if tid is None:
            continue
        text = tok.decode([tid])
        if text and tok.encode(text, add_bos=False, add_eos=False) != [tid]:
            raise DataError(f"tokenizer encodes its {name} token {text!r} as "
                            f"{tok.encode(text, add_bos=False, add_eos=False)}, expected [{tid}]")


def encode_dataset(examples: list[Example], tok, max_len: int, progress=None) -> EncodedDataset:
    """Encode every example into its rows (``encode_rows``: one, or one per assistant turn
    where the chat template is not prefix-consistent), in file order; ``report`` counts
    what expansion, truncation and dropping did. ``progress(done, total)`` is told as it
    goes."""
    check_special_tokens(tok)
    report = DataReport(examples=len(examples), max_len=max_len)
    items = []
    for i, ex in enumerate(examples):
        if progress is not None:
            progress(i, len(examples))
        rows = encode_rows(ex, tok, max_len)
        if len(rows) > 1:
            report.expanded += 1
            report.expanded_rows += len(rows)
        for enc in rows:
            if enc is None:
                report.dropped += 1
                report.dropped_lines.append(ex.line)
                continue
            items.append(enc)
            report.truncated += enc.truncated
            report.target_tokens += int(np.count_nonzero(enc.target_mask))
            report.total_tokens += len(enc.tokens)
    report.kept = len(items)
    return EncodedDataset(items, report)


# ------------------------------------------------------------------------- splitting, batching
def split_train_val(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Disjoint, deterministic split by example; both parts keep the original order. Of n
    examples val has round(n * val_fraction), at least 1 (and train at least 1) when
    val_fraction > 0 and n >= 2. The rows of a conversation expanded into one row per turn
    are one example and go to the same side: later rows repeat earlier replies in their
    prompts."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    groups = _examples_of(items)
    n = len(groups)
    if val_fraction == 0 or n < 2:
        return list(items), []
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    chosen = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train = [items[i] for g, rows in enumerate(groups) if g not in chosen for i in rows]
    val = [items[i] for g, rows in enumerate(groups) if g in chosen for i in rows]
    return train, val


def _examples_of(items: list) -> list[list[int]]:
    """Item indices grouped by example: consecutive rows of one expanded conversation (same
    line, ``turn`` set and increasing, as ``encode_dataset`` emits them) form one group;
    every other item (any row without ``turn``, a preference pair) is its own."""
    groups: list[list[int]] = []
    previous = None  # the previous item, if it is a row of an expanded conversation
    for i, item in enumerate(items):
        turn = getattr(item, "turn", None)
        if turn is not None and previous and previous.line == item.line and previous.turn < turn:
            groups[-1].append(i)
        else:
            groups.append([i])
        previous = item if turn is not None else None
    return groups


def pad_id_for(tok) -> int:
    """The padding id: the GGUF's pad token, else EOS, else 0 (padding is never a target)."""
    for tid in (tok.pad_id, tok.eos_id):
        if tid is not None:
            return int(tid)
    return 0


def steps_per_epoch(n_items: int, batch_size: int) -> int:
    return -(-n_items // batch_size)


class EpochBatches(Sequence):
    """One epoch's batches, each built when it is read (``make(i)``), so what an epoch
    holds is its order, not its arrays: 10^6 short rows at --seq-len 128 would be 1.5 GB of
    padded tokens, labels and positions, most of them padding."""

    def __init__(self, n: int, make):
        self._n, self._make = n, make

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._make(j) for j in range(*i.indices(self._n))]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(f"batch {i} of an epoch of {self._n}")
        return self._make(j)


def batches(items: list[Encoded], batch_size: int, seq_len: int, pad_id: int, *,
            shuffle: bool, seed: int, epoch: int) -> EpochBatches:
    """One epoch of fixed-shape batches. The order depends only on (seed, epoch), so a
    resumed run regenerates it; the last partial batch is filled with all-ignored rows.
    Every row is checked here; each batch's arrays are made when it is read."""
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    for item in items:
        if len(item.tokens) - 1 > seq_len:
            raise DataError(f"line {item.line}: {len(item.tokens)} tokens do not fit seq_len "
                            f"{seq_len} (at most seq_len + 1); encode with max_len <= seq_len")
    n = len(items)
    order = (np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n))
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1))

    def make(i: int) -> Batch:
        tokens = np.full((batch_size, seq_len), pad_id, dtype=np.int32)
        labels = np.full((batch_size, seq_len), -1, dtype=np.int32)
        real = 0
        for r, k in enumerate(order[i * batch_size:(i + 1) * batch_size]):
            item = items[k]
            ids = np.asarray(item.tokens, dtype=np.int64)
            m = len(ids) - 1
            tokens[r, :m] = ids[:-1]
            labels[r, :m] = np.where(np.asarray(item.target_mask[1:], dtype=bool), ids[1:], -1)
            real += m
        return Batch(tokens, positions.copy(), labels, int((labels != -1).sum()), real)
    return EpochBatches(steps_per_epoch(n, batch_size), make)


def data_hash(path) -> str:
    """sha256 of the file bytes, so a checkpoint can tell whether its data changed."""
    try:
        return file_sha256(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e}") from e
