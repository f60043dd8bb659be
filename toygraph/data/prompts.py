"""Prompt data (GRPO, recipes/grpo.py): JSONL prompts -> token ids -> prompt batches.

One JSON object per line (blank lines skipped): ``{"prompt": str | messages, ...}``. A
string is continued as it is (tokenized like any text); a list of ``{"role", "content"}``
messages ending with a user turn is rendered with the model's chat template and its
generation prompt (the ``### Instruction`` / ``### Response`` layout when the GGUF has
none), as TRL does. Every other key is a *field* of the row, handed to the reward
functions (``exact:answer`` compares with ``answer``). Rows have no reply: the completions
are sampled.

>>> rows = load_prompts("prompts.jsonl")                                   # doctest: +SKIP
>>> ds = encode_prompts(rows, tok, max_len=64)                             # doctest: +SKIP
>>> for b in prompt_batches(ds.items, 4, 64, pad, shuffle=True, seed=0, epoch=0): ...  # doctest: +SKIP

A prompt longer than ``max_len`` (``--seq-len``) keeps its last ``max_len`` tokens (TRL
truncates prompts on the left), counted in the report. A prompt batch is the
``toygraph.data.batches.Batch`` the training loop carries: ``tokens`` the prompts
right-padded, and ``labels`` no targets (there are none) but, in column 0, each row's
prompt id (``EncodedPrompt.index``) and, in column 1, 1 on the rows that only fill the
epoch's last batch (prompts seen earlier in it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toygraph.data.batches import Batch, check_special_tokens, steps_per_epoch
from toygraph.data.examples import _checked_text, _keys, _parse_messages, _type_name, load_examples
from toygraph.errors import DataError

SHAPE = '{"prompt": str | [{"role", "content"}, ...], ...fields for the rewards}'


@dataclass
class PromptRow:
    """One parsed row: the prompt (text, or messages ending with a user turn) and the
    row's other keys (``fields``)."""
    prompt: str | list[dict]
    fields: dict
    line: int = 0
    path: str | None = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class EncodedPrompt:
    """A prompt's token ids; ``index`` numbers it within its data file (what a prompt
    batch's labels carry)."""
    tokens: list[int]
    row: PromptRow
    index: int
    truncated: bool = False

    @property
    def line(self) -> int:
        return self.row.line


@dataclass
class PromptReport:
    prompts: int = 0
    truncated: int = 0
    total_tokens: int = 0
    longest: int = 0
    max_len: int = 0

    def __str__(self) -> str:
        return (f"{self.prompts} prompts, {self.total_tokens} tokens (longest {self.longest}); "
                f"{self.truncated} cut to their last {self.max_len} tokens (--seq-len)")


@dataclass
class PromptDataset:
    items: list[EncodedPrompt]
    report: PromptReport


def load_prompts(path) -> list[PromptRow]:
    """Parse a JSONL prompt file; DataError naming ``file:line`` on a bad row."""
    return load_examples(path, parse_row=_parse_prompt)


def _parse_prompt(obj, where: str, line: int, path: str) -> PromptRow:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {_type_name(obj)}; {SHAPE}")
    if "prompt" not in obj:
        raise DataError(f"{where}: no 'prompt' (keys found: {_keys(obj) or 'none'}); {SHAPE}")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        prompt = _checked_text(prompt, where, "'prompt'")
    elif isinstance(prompt, list):
        prompt = _parse_messages(prompt, where, need_assistant=False)
        if prompt[-1]["role"] != "user":
            raise DataError(f"{where}: 'prompt' messages must end with a user turn (the "
                            f"completion answers it), found {prompt[-1]['role']!r} last")
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages, found "
                        f"{_type_name(prompt)}")
    fields = {k: v for k, v in obj.items() if k != "prompt"}
    return PromptRow(prompt, fields, line=line, path=path)


def prompt_text(row: PromptRow, tok, tools: list[dict] | None = None) -> str:
    """The text the model continues: the string itself, or the messages rendered with the
    chat template in use (the model's, or its default: gguf/templates.py) and its generation
    prompt; ``tools`` (JSON schemas, GRPO's --tools) reach the template's ``tools``, as the
    SFT rows' do (data/encoding.py), so only a chat prompt can have them."""
    where = f"{row.path or '<data>'}:{row.line}"
    if not row.conversational:
        if tools:
            raise DataError(f"{where}: --tools needs chat prompts (a list of messages, whose "
                            "rendering describes the tools); this prompt is a string")
        return row.prompt
    try:
        return tok.apply_chat_template(row.prompt, add_generation_prompt=True,
                                       **({"tools": tools} if tools else {}))
    except Exception as e:  # the template's own error (raise_exception, ...): add the data line
        raise DataError(f"{where}: the chat template failed on this prompt: {e}") from None


def prompt_token_ids(text: str, tok) -> list[int]:
    """``text``'s token ids, with the BOS the GGUF asks for unless the text (a template's
    rendering) begins with it already."""
    bos_text = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
    double = bool(bos_text) and text.startswith(bos_text)
    return tok.encode(text, add_bos=False if double else None, add_eos=False)


def encode_prompts(rows: list[PromptRow], tok, max_len: int, progress=None) -> PromptDataset:
    """Every prompt's token ids (a template that writes the BOS text itself gets no second
    one), cut to the last ``max_len`` tokens; ``progress(done, total)`` is told as it goes."""
    if max_len < 1:
        raise DataError(f"max_len must be >= 1, got {max_len}")
    check_special_tokens(tok)
    report = PromptReport(prompts=len(rows), max_len=max_len)
    items = []
    for i, row in enumerate(rows):
        if progress is not None:
            progress(i, len(rows))
        ids = prompt_token_ids(prompt_text(row, tok), tok)
        if not ids:
            raise DataError(f"{row.path or '<data>'}:{row.line}: the prompt encodes to no tokens")
        cut = len(ids) > max_len
        ids = ids[-max_len:]
        items.append(EncodedPrompt(ids, row, i, cut))
        report.truncated += cut
        report.total_tokens += len(ids)
        report.longest = max(report.longest, len(ids))
    return PromptDataset(items, report)


def prompt_batches(items: list[EncodedPrompt], batch_size: int, seq_len: int, pad_id: int, *,
                   shuffle: bool, seed: int, epoch: int, repeat: int = 1) -> list[Batch]:
    """One epoch of [batch_size, seq_len] prompt batches (module docstring), each given
    ``repeat`` times in a row (GRPO's updates per rollout take the same prompts). The
    order depends only on (seed, epoch); the last batch is filled from the epoch's start."""
    if batch_size < 1 or seq_len < 1 or repeat < 1:
        raise DataError(f"batch_size, seq_len and repeat must be >= 1, got {batch_size}, "
                        f"{seq_len}, {repeat}")
    n = len(items)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    rows = steps_per_epoch(n, batch_size) * batch_size
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1))
    out = []
    for s in range(0, rows, batch_size):
        tokens = np.full((batch_size, seq_len), pad_id, np.int32)
        labels = np.full((batch_size, seq_len), -1, np.int32)
        real = 0
        for r in range(batch_size):
            item = items[order[(s + r) % n]]
            if len(item.tokens) > seq_len:
                raise DataError(f"line {item.line}: a prompt of {len(item.tokens)} tokens does "
                                f"not fit seq_len {seq_len}; encode with max_len <= seq_len")
            tokens[r, :len(item.tokens)] = item.tokens
            labels[r, 0] = item.index
            if seq_len > 1:
                labels[r, 1] = int(s + r >= n)
            real += len(item.tokens)
        out += [Batch(tokens, positions.copy(), labels, 0, real)] * repeat
    return out
