"""Sample packing: several short examples share one row of ``seq_len`` slots.

Examples are placed into rows by a first-fit-decreasing bin packer: longest first, each
into the first row with room (ties in length in a shuffled order, so a seed and an epoch
give one packing and a resumed run regenerates it). Every token carries a segment id
(1, 2, ... per example in its row; 0 for padding), which the fused attention uses to keep
each example to itself; positions restart at 0 for each example and labels stay per
example (an example's last token never predicts the next example's first), so the summed
loss, and so the token-weighted mean, is exactly that of the same examples unpacked.

>>> rows = first_fit_decreasing([5, 3, 4, 2], capacity=8)     # doctest: +SKIP
>>> rows                                                      # doctest: +SKIP
[[0, 1], [2, 3]]
>>> for b in packed_batches(items, 4, 128, pad, shuffle=True, seed=0, epoch=0): ...  # doctest: +SKIP
"""
from __future__ import annotations

import numpy as np

from toygraph.data.batches import Batch, EpochBatches, batches, steps_per_epoch
from toygraph.errors import DataError

__all__ = ["first_fit_decreasing", "packed_batches", "epoch_batches", "batches_per_epoch",
           "packing_efficiency", "labelled_share"]


def _slots(item) -> int:
    """Row slots an encoded example takes: its inputs, tokens[:-1] (the last token is only
    a target)."""
    return len(item.tokens) - 1


def first_fit_decreasing(sizes, capacity: int, order=None) -> list[list[int]]:
    """Indices of ``sizes`` grouped into rows holding at most ``capacity`` each, longest
    first into the first row with room. ``order`` (a permutation) breaks ties in size;
    without it, the lower index goes first. Rows come in the order they were opened."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.size and (sizes.min() < 1 or sizes.max() > capacity):
        bad = int(sizes[(sizes < 1) | (sizes > capacity)][0])
        raise DataError(f"packing: an example of {bad} slots does not fit rows of {capacity}")
    rank = np.arange(len(sizes)) if order is None else np.argsort(np.asarray(order))
    queue = np.lexsort((rank, -sizes))     # by size descending, then by rank
    room = np.empty(len(sizes), dtype=np.int64)   # free slots per open row (at most n rows)
    rows: list[list[int]] = []
    for i in queue:
        fits = np.flatnonzero(room[:len(rows)] >= sizes[i])
        if fits.size:
            r = int(fits[0])
        else:
            r = len(rows)
            rows.append([])
            room[r] = capacity
        rows[r].append(int(i))
        room[r] -= sizes[i]
    return rows


def _rows(items, seq_len: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
    """The packed rows of one epoch: ties broken and rows ordered by the (seed, epoch)
    generator, so the packing is a pure function of them."""
    n = len(items)
    if not shuffle:
        return first_fit_decreasing([_slots(x) for x in items], seq_len)
    rng = np.random.default_rng([seed, epoch])
    rows = first_fit_decreasing([_slots(x) for x in items], seq_len, order=rng.permutation(n))
    return [rows[r] for r in rng.permutation(len(rows))]


def packed_batches(items: list, batch_size: int, seq_len: int, pad_id: int, *, shuffle: bool,
                   seed: int, epoch: int) -> EpochBatches:
    """One epoch of packed fixed-shape batches (``Batch.segments`` set); the last partial
    batch is filled with all-padding rows, as unpacked. The packing is made here, each
    batch's arrays when it is read (data.batches.EpochBatches)."""
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    for item in items:
        if _slots(item) > seq_len:
            raise DataError(f"line {item.line}: {len(item.tokens)} tokens do not fit seq_len "
                            f"{seq_len} (at most seq_len + 1); encode with max_len <= seq_len")
    rows = _rows(items, seq_len, shuffle, seed, epoch)

    def make(i: int) -> Batch:
        shape = (batch_size, seq_len)
        tokens, labels = np.full(shape, pad_id, np.int32), np.full(shape, -1, np.int32)
        positions, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        for r, row in enumerate(rows[i * batch_size:(i + 1) * batch_size]):
            at = 0
            for sid, k in enumerate(row, start=1):
                ids = np.asarray(items[k].tokens, dtype=np.int64)
                m = len(ids) - 1
                span = slice(at, at + m)
                tokens[r, span] = ids[:-1]
                labels[r, span] = np.where(np.asarray(items[k].target_mask[1:], bool), ids[1:], -1)
                positions[r, span] = np.arange(m)
                segments[r, span] = sid
                at += m
        return Batch(tokens, positions, labels, int((labels != -1).sum()),
                     real_tokens=int((segments > 0).sum()), segments=segments)
    return EpochBatches(steps_per_epoch(len(rows), batch_size), make)


def epoch_batches(items: list, batch_size: int, seq_len: int, pad_id: int, *, pack: bool,
                  shuffle: bool, seed: int, epoch: int) -> list[Batch]:
    """One epoch of batches, packed or one example per row (data.batches)."""
    make = packed_batches if pack else batches
    return make(items, batch_size, seq_len, pad_id, shuffle=shuffle, seed=seed, epoch=epoch)


def batches_per_epoch(items: list, batch_size: int, seq_len: int, pack: bool) -> int:
    """How many batches one epoch has. Packed, it is the same every epoch: first-fit
    decreasing sees the same sorted sizes whatever order breaks the ties."""
    rows = len(first_fit_decreasing([_slots(x) for x in items], seq_len)) if pack else len(items)
    return steps_per_epoch(rows, batch_size)


def packing_efficiency(items: list, batch_size: int, seq_len: int) -> dict:
    """Real (non-padding) input tokens per slot of one epoch's batches, one example per row
    and packed: {"real_tokens", "unpacked", "packed"}."""
    real = sum(_slots(x) for x in items)
    slots = {p: batches_per_epoch(items, batch_size, seq_len, p) * batch_size * seq_len
             for p in (False, True)}
    return {"real_tokens": real, "unpacked": real / slots[False], "packed": real / slots[True]}


def labelled_share(items: list, batch_size: int, seq_len: int, pack: bool) -> float:
    """The share of one epoch's row slots that carry a label (a target token): what a head
    fused with the loss computes on (it skips the unlabelled rows, recipes/base.py's
    fused_head)."""
    labelled = sum(int(np.count_nonzero(np.asarray(x.target_mask[1:], bool))) for x in items)
    slots = batches_per_epoch(items, batch_size, seq_len, pack) * batch_size * seq_len
    return labelled / slots if slots else 0.0
