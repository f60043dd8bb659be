"""Preference data (DPO, ORPO): JSONL pairs -> encoded (chosen, rejected) -> pair batches.

Accepted JSONL shapes (one object per line; blank lines skipped, extra keys ignored):

- ``{"prompt": str, "chosen": str, "rejected": str}``: one user turn and two alternative
  assistant replies, rendered with the model's chat template;
- ``{"messages": [...], "chosen": {"role": "assistant", "content": str}, "rejected": {...}}``:
  a shared conversation prefix ending in a user turn, and two alternative replies.

Only the final reply's tokens (and its end-of-turn token) are targets. A micro-batch of
``batch`` pairs is ``2 * batch`` rows: the chosen sequences, then the rejected ones in the
same order (what recipes/dpo.py expects).

>>> pairs = load_pairs("fixtures/data/preferences.jsonl")                 # doctest: +SKIP
>>> ds = encode_pairs(pairs, tok, max_len=64)                              # doctest: +SKIP
>>> for b in pair_batches(ds.items, 2, 64, pad, shuffle=True, seed=0, epoch=0): ...  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toygraph.data.batches import (Batch, DataReport, EncodedDataset, EpochBatches, batches,
                                   check_special_tokens, encode_example)
from toygraph.data.examples import (Example, _checked_text, _keys, _parse_messages, _string,
                                    _type_name, load_examples)
from toygraph.errors import DataError

SHAPES = ('{"prompt", "chosen", "rejected"} (strings)',
          '{"messages": [...], "chosen": {"role": "assistant", "content"}, "rejected": {...}}')


@dataclass
class PreferencePair:
    """One parsed row: the conversation before the replies, and the two replies."""
    prompt: list[dict]
    chosen: str
    rejected: str
    line: int = 0
    path: str | None = None

    def example(self, reply: str) -> Example:
        """The conversation ending in ``reply``, as an SFT example."""
        messages = self.prompt + [{"role": "assistant", "content": reply}]
        return Example(messages=messages, line=self.line, path=self.path)


def load_pairs(path) -> list[PreferencePair]:
    """Parse a JSONL preference file; DataError naming ``file:line`` (and the key) on any
    bad row, with toygraph.data.examples' bounds on hostile files."""
    return load_examples(path, parse_row=_parse_pair)


def _parse_pair(obj, where: str, line: int, path: str) -> PreferencePair:
    accepted = "accepted shapes: " + "; ".join(SHAPES)
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {_type_name(obj)}; {accepted}")
    shapes = [k for k in ("prompt", "messages") if k in obj]
    missing = [k for k in ("chosen", "rejected") if k not in obj]
    if len(shapes) != 1 or missing:
        what = ("ambiguous row" if len(shapes) > 1 else
                f"missing {' and '.join(repr(k) for k in missing)}" if shapes and missing
                else "not a preference row")
        raise DataError(f"{where}: {what} (keys found: {_keys(obj) or 'none'}); {accepted}")
    if shapes[0] == "prompt":
        prompt = [{"role": "user", "content": _string(obj, "prompt", where)}]
        replies = [_string(obj, k, where) for k in ("chosen", "rejected")]
    else:
        prompt = _parse_messages(obj["messages"], where, need_assistant=False)
        if prompt[-1]["role"] != "user":
            raise DataError(f"{where}: 'messages' must end with a user turn (the replies answer "
                            f"it), found {prompt[-1]['role']!r} last")
        replies = [_reply(obj[k], k, where) for k in ("chosen", "rejected")]
    return PreferencePair(prompt, replies[0], replies[1], line=line, path=path)


def _reply(value, key: str, where: str) -> str:
    if not isinstance(value, dict):
        raise DataError(f"{where}: '{key}' must be an object {{\"role\": \"assistant\", "
                        f"\"content\": ...}}, found {_type_name(value)}")
    role = value.get("role", "assistant")
    if role != "assistant":
        raise DataError(f"{where}: '{key}.role' must be 'assistant', found {role!r}")
    content = value.get("content")
    if not isinstance(content, str):
        raise DataError(f"{where}: '{key}.content' must be a string, found {_type_name(content)}")
    return _checked_text(content, where, f"'{key}.content'")


def encode_pairs(pairs: list[PreferencePair], tok, max_len: int, progress=None) -> EncodedDataset:
    """Encode both replies of every pair; items are (chosen, rejected) ``Encoded``. A pair
    is dropped when either reply has no target token left within ``max_len + 1`` tokens.
    ``progress(done, total)`` is told as it goes."""
    check_special_tokens(tok)
    report = DataReport(examples=len(pairs), max_len=max_len)
    items = []
    for i, pair in enumerate(pairs):
        if progress is not None:
            progress(i, len(pairs))
        enc = [encode_example(pair.example(r), tok, max_len, last_turn_only=True)
               for r in (pair.chosen, pair.rejected)]
        if None in enc:
            report.dropped += 1
            report.dropped_lines.append(pair.line)
            continue
        items.append(tuple(enc))
        report.truncated += any(e.truncated for e in enc)
        report.target_tokens += sum(int(np.count_nonzero(e.target_mask)) for e in enc)
        report.total_tokens += sum(len(e.tokens) for e in enc)
    report.kept = len(items)
    return EncodedDataset(items, report)


def pair_batches(items: list[tuple], batch_size: int, seq_len: int, pad_id: int, *,
                 shuffle: bool, seed: int, epoch: int) -> EpochBatches:
    """One epoch of [2 * batch_size, seq_len] batches of (chosen, rejected) pairs: chosen
    rows first, rejected rows in the same order. The order depends only on (seed, epoch);
    the last partial batch is filled with all-ignored pairs."""
    order = (np.random.default_rng([seed, epoch]).permutation(len(items)) if shuffle
             else np.arange(len(items)))
    halves = [batches([items[k][side] for k in order], batch_size, seq_len, pad_id,
                      shuffle=False, seed=seed, epoch=epoch) for side in (0, 1)]

    def make(i: int) -> Batch:
        c, r = halves[0][i], halves[1][i]
        return Batch(*(np.concatenate([getattr(c, f), getattr(r, f)])
                       for f in ("tokens", "positions", "labels")), c.n_targets + r.n_targets,
                     c.real_tokens + r.real_tokens)
    return EpochBatches(len(halves[0]), make)
