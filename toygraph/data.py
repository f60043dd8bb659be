"""Fine-tuning data: JSONL examples -> token ids with a target mask -> static-shape batches.

The flow is ``load_examples`` (parse and validate, errors name file:line) ->
``encode_dataset`` (render with the model's chat template, tokenize, mask, truncate) ->
``split_train_val`` -> ``batches`` (one epoch of fixed-shape numpy batches, a pure function
of seed and epoch so a resumed run regenerates the same order).

>>> from toygraph.tokenizer import Tokenizer                     # doctest: +SKIP
>>> tok = Tokenizer.from_gguf(gguf_path)                          # doctest: +SKIP
>>> ds = encode_dataset(load_examples("capitals.jsonl"), tok, max_len=64)  # doctest: +SKIP
>>> print(ds.report)                                              # doctest: +SKIP
>>> train, val = split_train_val(ds.items, 0.1, seed=0)           # doctest: +SKIP
>>> for b in batches(train, 4, 64, pad_id_for(tok), shuffle=True, seed=0, epoch=0): ...  # doctest: +SKIP

The accepted JSONL shapes and the limits on hostile files are in ``toygraph.examples``
(``load_examples`` and ``Example`` are re-exported here).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from toygraph.errors import DataError
from toygraph.examples import Example, load_examples

__all__ = ["Example", "Encoded", "DataReport", "EncodedDataset", "Batch", "load_examples",
           "encode_example", "encode_dataset", "check_special_tokens", "split_train_val",
           "pad_id_for", "steps_per_epoch", "batches", "data_hash"]

# Used when the GGUF has no chat template (base models). Each assistant turn is followed by
# EOS, so the model learns to stop; the prompt for generation ends with "### Response:\n".
FALLBACK_HEADERS = {"system": "### System:", "user": "### Instruction:", "assistant": "### Response:"}


@dataclass
class Encoded:
    """Token ids of one example; ``target_mask[i]`` says whether ``tokens[i]`` is trained on
    (predicted from ``tokens[:i]``). At most ``max_len + 1`` tokens."""
    tokens: list[int]
    target_mask: list[bool]
    truncated: bool
    line: int


@dataclass
class DataReport:
    examples: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    target_tokens: int = 0
    total_tokens: int = 0
    max_len: int = 0
    dropped_lines: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.examples} examples: {self.kept} kept, {self.truncated} truncated to "
                f"{self.max_len + 1} tokens, {self.dropped} dropped (no target token left); "
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
    (toygraph.packing): each slot's example within its row, 0 for padding."""
    tokens: np.ndarray
    positions: np.ndarray
    labels: np.ndarray
    n_targets: int
    real_tokens: int = 0
    segments: np.ndarray | None = None


# ------------------------------------------------------------------------- encoding
def encode_example(ex: Example, tok, max_len: int, last_turn_only: bool = False) -> Encoded | None:
    """Tokenize one example with its target mask; None when no target token survives
    truncation to ``max_len + 1`` tokens (inputs are ``tokens[:-1]``, targets ``tokens[1:]``).

    Chats are rendered with ``tok.apply_chat_template`` (or the ``### Instruction`` /
    ``### Response`` fallback when the GGUF has none); every assistant turn's content and
    its end-of-turn token are targets (only the last turn's with ``last_turn_only``, as
    preference pairs want). Plain text: every token is a target, and EOS follows.
    """
    if max_len < 1:
        raise DataError(f"max_len must be >= 1, got {max_len}")
    if ex.text is not None:
        tokens = tok.encode(ex.text, add_bos=None, add_eos=False)
        if tok.eos_id is not None:
            tokens.append(tok.eos_id)  # teach where a document ends
        mask = [True] * len(tokens)
    else:
        tokens, mask = _encode_chat(ex, tok)
        if last_turn_only:
            mask = _last_run(mask)
    # Under causal attention nothing after the last target can change the loss: drop it
    # (e.g. the "\n" a template puts after <|im_end|>) rather than spend sequence on it.
    while mask and not mask[-1]:
        tokens.pop()
        mask.pop()
    if mask:
        mask[0] = False  # the first token has no predecessor to be predicted from
    # Keep a leading BOS through truncation only where the tokenizer adds one by itself (a
    # real start-of-sequence marker); SmolLM2's "BOS" is <|im_start|>, just template text.
    keep_bos = (tok.bos_id is not None and tokens[:1] == [tok.bos_id]
                and tok.encode("", add_bos=None, add_eos=False)[:1] == [tok.bos_id])
    tokens, mask, truncated = _truncate(tokens, mask, max_len + 1, keep_bos)
    if not any(mask):
        return None
    return Encoded(tokens, mask, truncated, ex.line)


def _encode_chat(ex: Example, tok) -> tuple[list[int], list[bool]]:
    """Render incrementally: the text before assistant turn i is the rendering of
    messages[:i] with a generation prompt, its target is what the rendering of messages[:i+1]
    adds to that. Each piece is tokenized on its own, exactly as at inference, where the
    prompt is tokenized and the model continues it, so the mask boundary is exact."""
    fallback = not tok.chat_template
    msgs = ex.messages
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    bos_text = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
    tokens: list[int] = []
    mask: list[bool] = []
    done = ""  # the rendered text already tokenized
    for i in range(last + 1):
        if msgs[i]["role"] != "assistant":
            continue
        prompt = _render(tok, msgs[:i], True, ex, fallback)
        full = _render(tok, msgs[:i + 1], False, ex, fallback)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise DataError(f"{ex.where}: the chat template renders the conversation before "
                            f"messages[{i}] differently from its start in the longer rendering, "
                            f"so the assistant turn cannot be located for the loss mask")
        piece = prompt[len(done):]
        # Let the tokenizer add BOS only if the template did not render one itself.
        add_bos = None if not tokens and not (bos_text and piece.startswith(bos_text)) else False
        ids = tok.encode(piece, add_bos=add_bos, add_eos=False)
        tokens += ids
        mask += [False] * len(ids)

        reply = tok.encode(full[len(prompt):], add_bos=False, add_eos=False)
        end = _end_of_turn_index(reply, tok)
        if end is None:
            rest = []
            if (i == last or fallback) and tok.eos_id is not None:
                reply = reply + [tok.eos_id]  # the template does not close the turn: EOS does
        else:
            reply, rest = reply[:end + 1], reply[end + 1:]
        tokens += reply + rest
        mask += [True] * len(reply) + [False] * len(rest)
        done = full
    return tokens, mask


def _last_run(mask: list[bool]) -> list[bool]:
    """Only the last run of targets: the last assistant turn (a user turn's header, never a
    target, separates two assistant turns)."""
    end = len(mask) - mask[::-1].index(True) if True in mask else 0
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [start <= i < end for i in range(len(mask))]


def _render(tok, messages: list[dict], add_generation_prompt: bool, ex: Example, fallback: bool) -> str:
    if fallback:
        text = "\n\n".join(f"{FALLBACK_HEADERS[m['role']]}\n{m['content']}" for m in messages)
        if add_generation_prompt:
            text += ("\n\n" if text else "") + FALLBACK_HEADERS["assistant"] + "\n"
        return text
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except DataError:
        raise
    except Exception as e:  # jinja raise_exception etc.: add the data line to the message
        raise DataError(f"{ex.where}: the chat template failed on this example: {e}") from e


def _end_of_turn_index(reply: list[int], tok) -> int | None:
    """Index of the token closing the turn (one of ``tok.end_of_turn_ids``, the same ids
    generation stops on), looking back only over trailing whitespace (templates put "\\n"
    after <|im_end|>); None if the reply ends in plain content."""
    for j in range(len(reply) - 1, -1, -1):
        if reply[j] in tok.end_of_turn_ids:
            return j
        if tok.decode([reply[j]]).strip():
            return None
    return None


def _truncate(tokens: list[int], mask: list[bool], limit: int, keep_bos: bool):
    """Cut to ``limit`` tokens keeping the tail of the prompt and the head of the response:
    the prompt keeps everything the response leaves free, but at most half the window when
    both are long, so a response is never dropped whole. ``keep_bos`` keeps tokens[0]."""
    if len(tokens) <= limit or True not in mask:
        return tokens, mask, False
    first = mask.index(True)
    head = 1 if keep_bos else 0
    room = limit - head
    prompt, response = first - head, len(tokens) - first
    prompt_keep = min(prompt, max(room - response, room // 2))
    start = first - prompt_keep
    tokens = tokens[:head] + tokens[start:start + room]
    mask = mask[:head] + mask[start:start + room]
    mask[0] = False
    return tokens, mask, True


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


def encode_dataset(examples: list[Example], tok, max_len: int) -> EncodedDataset:
    """Encode every example; ``report`` counts what truncation and dropping did."""
    check_special_tokens(tok)
    report = DataReport(examples=len(examples), max_len=max_len)
    items = []
    for ex in examples:
        enc = encode_example(ex, tok, max_len)
        if enc is None:
            report.dropped += 1
            report.dropped_lines.append(ex.line)
            continue
        items.append(enc)
        report.truncated += enc.truncated
        report.target_tokens += sum(enc.target_mask)
        report.total_tokens += len(enc.tokens)
    report.kept = len(items)
    return EncodedDataset(items, report)


# ------------------------------------------------------------------------- splitting, batching
def split_train_val(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Disjoint, deterministic split; both parts keep the original order. Val has
    round(n * val_fraction) items, at least 1 (and train at least 1) when val_fraction > 0
    and n >= 2."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(items)
    if val_fraction == 0 or n < 2:
        return list(items), []
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    chosen = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train = [x for i, x in enumerate(items) if i not in chosen]
    val = [x for i, x in enumerate(items) if i in chosen]
    return train, val


def pad_id_for(tok) -> int:
    """The padding id: the GGUF's pad token, else EOS, else 0 (padding is never a target)."""
    for tid in (tok.pad_id, tok.eos_id):
        if tid is not None:
            return int(tid)
    return 0


def steps_per_epoch(n_items: int, batch_size: int) -> int:
    return -(-n_items // batch_size)


def batches(items: list[Encoded], batch_size: int, seq_len: int, pad_id: int, *,
            shuffle: bool, seed: int, epoch: int) -> list[Batch]:
    """One epoch of fixed-shape batches. The order depends only on (seed, epoch), so a
    resumed run regenerates it; the last partial batch is filled with all-ignored rows."""
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    n = len(items)
    order = (np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n))
    rows = steps_per_epoch(n, batch_size) * batch_size
    tokens = np.full((rows, seq_len), pad_id, dtype=np.int32)
    labels = np.full((rows, seq_len), -1, dtype=np.int32)
    real = np.zeros(rows, dtype=np.int64)
    for r, k in enumerate(order):
        item = items[k]
        ids = np.asarray(item.tokens, dtype=np.int64)
        if len(ids) - 1 > seq_len:
            raise DataError(f"line {item.line}: {len(ids)} tokens do not fit seq_len {seq_len} "
                            f"(at most seq_len + 1); encode with max_len <= seq_len")
        m = real[r] = len(ids) - 1
        tokens[r, :m] = ids[:-1]
        labels[r, :m] = np.where(np.asarray(item.target_mask[1:], dtype=bool), ids[1:], -1)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1))
    out = []
    for s in range(0, rows, batch_size):
        lab = labels[s:s + batch_size]
        out.append(Batch(tokens[s:s + batch_size].copy(), positions.copy(), lab.copy(),
                         int((lab != -1).sum()), int(real[s:s + batch_size].sum())))
    return out


def data_hash(path) -> str:
    """sha256 of the file bytes, so a checkpoint can tell whether its data changed."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e}") from e
    return h.hexdigest()
