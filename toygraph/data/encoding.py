"""One example -> the token ids of its training rows, each with a target mask.

``encode_rows`` renders a chat with the model's chat template (the GGUF's, or the one the
run chose: toygraph/gguf/templates.py, whose default for a GGUF without one is the Alpaca
layout), tokenizes it exactly as inference would, marks the assistant replies as targets and truncates to ``max_len + 1``
tokens; plain text trains on every token. An example is one row, except a multi-turn chat
whose template is not prefix-consistent (Qwen3): one row per assistant turn (see
``encode_rows``). ``toygraph.data.batches`` encodes whole datasets with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toygraph.data.examples import Example
from toygraph.errors import DataError

__all__ = ["Encoded", "encode_rows", "encode_example"]


@dataclass(eq=False)
class Encoded:
    """Token ids of one training row; ``target_mask[i]`` says whether ``tokens[i]`` is trained
    on (predicted from ``tokens[:i]``). At most ``max_len + 1`` tokens. ``turn`` is set on
    the rows of a conversation expanded into one row per assistant turn (``encode_rows``):
    the index in ``messages`` of the turn the row trains on. Both are numpy arrays (int32,
    bool): a dataset holds every row from the start, and as Python lists they took ~40
    bytes a token against these 5 (plus ~250 a row)."""
    tokens: np.ndarray
    target_mask: np.ndarray
    truncated: bool
    line: int
    turn: int | None = None

    def __eq__(self, other) -> bool:
        return (isinstance(other, Encoded) and np.array_equal(self.tokens, other.tokens)
                and np.array_equal(self.target_mask, other.target_mask)
                and (self.truncated, self.line, self.turn) == (other.truncated, other.line,
                                                               other.turn))


def encode_rows(ex: Example, tok, max_len: int, last_turn_only: bool = False) -> list[Encoded | None]:
    """The training rows of one example: each an ``Encoded``, or None where no target token
    survives truncation to ``max_len + 1`` tokens (inputs are ``tokens[:-1]``, targets
    ``tokens[1:]``).

    Plain text is one row, every token a target, EOS appended. A raw prompt/completion
    (strings) is one row: the prompt tokenized as generation would be given it, then the
    completion and EOS as targets (TRL's convention: EOS is appended to a completion that
    does not end with it). Chats are rendered with
    ``tok.apply_chat_template`` (the template in use, templates.py); each assistant turn's reply, up to and including its end-of-turn
    token, is a target, and nothing else is (with ``ex.train_from``, a conversational
    prompt/completion, only the turns of the completion). The row's ``tools`` reach the
    template as transformers' ``apply_chat_template(tools=...)`` passes them. For each assistant turn i, the rendering of
    ``messages[:i]`` with the generation prompt (what the model is given at inference before
    turn i) must be where the rendering of ``messages[:i+1]`` starts. How the turns become
    rows depends on whether the template is also *prefix-consistent* for the conversation:
    the rendering through each assistant turn is where the next turn's prompt starts.

    - prefix-consistent (ChatML as SmolLM2 has it, Gemma 3, ...): one row, the whole
      conversation, every assistant turn a target (only the last with ``last_turn_only``,
      as preference pairs want);
    - not prefix-consistent (Qwen3 writes a turn's <think> block only while no user message
      follows it, and an empty one into a last turn without reasoning): one row per
      assistant turn i, the rendering of ``messages[:i]`` with the generation prompt
      followed by the reply (the rendering of ``messages[:i+1]`` past that prompt), the
      reply alone a target. Each row is exactly what inference sees at that turn, which a
      single row cannot be (the expansion ms-swift's maintainers advise for Qwen3; TRL
      instead swaps in a prefix-preserving training template, whose history then differs
      from inference's). With ``last_turn_only`` only the last turn's row.

    A template whose rendering of ``messages[:i+1]`` does not even start with turn i's prompt
    cannot be split at all: a DataError names the line.
    """
    if max_len < 1:
        raise DataError(f"max_len must be >= 1, got {max_len}")
    if ex.text is not None:
        tokens = tok.encode(ex.text, add_bos=None, add_eos=False)
        if tok.eos_id is not None:
            tokens.append(tok.eos_id)  # teach where a document ends
        return [_finish(tokens, [True] * len(tokens), tok, max_len, ex.line)]
    if ex.prompt is not None:
        return [_finish(*_raw_prompt_completion(ex, tok), tok, max_len, ex.line)]
    turns = _chat_turns(ex, tok)
    if all(later.prompt.startswith(earlier.full) for earlier, later in zip(turns, turns[1:])):
        tokens, mask = _one_row(turns, tok)
        if last_turn_only:
            mask = _last_run(mask)
        return [_finish(tokens, mask, tok, max_len, ex.line)]
    return [_finish(*_turn_row(turn, tok), tok, max_len, ex.line, turn.index)
            for turn in (turns[-1:] if last_turn_only else turns)]


def encode_example(ex: Example, tok, max_len: int, last_turn_only: bool = False) -> Encoded | None:
    """The single row of an example (see ``encode_rows``); None when no target token survives
    truncation. A conversation the template expands into one row per assistant turn is a
    DataError here: ``encode_dataset`` (or ``encode_rows``) takes those."""
    rows = encode_rows(ex, tok, max_len, last_turn_only)
    if len(rows) > 1:
        raise DataError(f"{ex.where}: the chat template is not prefix-consistent, so this "
                        f"conversation is {len(rows)} training rows (one per assistant turn); "
                        f"encode it with encode_rows or encode_dataset")
    return rows[0]


@dataclass
class _Turn:
    """Assistant turn ``index``: ``prompt`` renders messages[:index] with the generation
    prompt, ``full`` renders messages[:index + 1]; ``prompt`` is a prefix of ``full``."""
    index: int
    prompt: str
    full: str


def _chat_turns(ex: Example, tok) -> list[_Turn]:
    """Render the conversation before and through each assistant turn (the turns after the
    last assistant message train nothing and are not rendered)."""
    turns = []
    for i, message in enumerate(ex.messages):
        if message["role"] != "assistant" or i < ex.train_from:
            continue
        prompt = _render(tok, ex.messages[:i], True, ex)
        full = _render(tok, ex.messages[:i + 1], False, ex)
        if not full.startswith(prompt):
            raise DataError(f"{ex.where}: the chat template renders the conversation before "
                            f"messages[{i}] (with the generation prompt) as text the rendering "
                            f"through messages[{i}] does not start with, so the assistant turn "
                            f"cannot be located for the loss mask")
        turns.append(_Turn(i, prompt, full))
    return turns


def _raw_prompt_completion(ex: Example, tok) -> tuple[list[int], list[bool]]:
    """A raw prompt and completion: the prompt tokenized on its own (BOS as the tokenizer
    adds it), as a prompt is at inference, so the boundary is exact; the completion after
    it, closed with EOS unless it already ends with it. TRL tokenizes the concatenation and
    warns where the two differ; here they never do."""
    ids = tok.encode(ex.prompt, add_bos=None, add_eos=False)
    reply = tok.encode(ex.completion, add_bos=False, add_eos=False)
    if tok.eos_id is not None and reply[-1:] != [tok.eos_id]:
        reply.append(tok.eos_id)
    return ids + reply, [False] * len(ids) + [True] * len(reply)


def _one_row(turns: list[_Turn], tok) -> tuple[list[int], list[bool]]:
    """A prefix-consistent conversation as one row: the text before each reply is what the
    rendering through that turn adds to the one before, tokenized on its own as at
    inference (where the prompt is tokenized and the model continues it), so the mask
    boundary is exact."""
    tokens: list[int] = []
    mask: list[bool] = []
    done = ""  # the rendered text already tokenized
    for turn in turns:
        ids = _prompt_ids(turn.prompt[len(done):], tok, first=not tokens)
        # An open-ended template (no end-of-turn token) gets EOS after the last reply only:
        # elsewhere the next turn's header follows.
        reply, rest = _reply_ids(turn.full[len(turn.prompt):], tok,
                                 close_with_eos=turn is turns[-1])
        tokens += ids + reply + rest
        mask += [False] * len(ids) + [True] * len(reply) + [False] * len(rest)
        done = turn.full
    return tokens, mask


def _turn_row(turn: _Turn, tok) -> tuple[list[int], list[bool]]:
    """One assistant turn as its own row: its prompt, then its reply as the target."""
    ids = _prompt_ids(turn.prompt, tok, first=True)
    reply, _ = _reply_ids(turn.full[len(turn.prompt):], tok, close_with_eos=True)
    return ids + reply, [False] * len(ids) + [True] * len(reply)


def _prompt_ids(text: str, tok, first: bool) -> list[int]:
    """Prompt text as ids; at the start of a row the tokenizer adds BOS (if it does) only
    when the template did not render one itself."""
    bos_text = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
    add_bos = None if first and not (bos_text and text.startswith(bos_text)) else False
    return tok.encode(text, add_bos=add_bos, add_eos=False)


def _reply_ids(text: str, tok, close_with_eos: bool) -> tuple[list[int], list[int]]:
    """A reply's ids, split into the target (through its end-of-turn token) and the rest
    (the "\\n" a template puts after it). A reply the template does not close gets EOS
    appended when ``close_with_eos``, so the model learns to stop."""
    reply = tok.encode(text, add_bos=False, add_eos=False)
    end = _end_of_turn_index(reply, tok)
    if end is not None:
        return reply[:end + 1], reply[end + 1:]
    if close_with_eos and tok.eos_id is not None:
        reply = reply + [tok.eos_id]
    return reply, []


def _finish(tokens: list[int], mask: list[bool], tok, max_len: int, line: int,
            turn: int | None = None) -> Encoded | None:
    """Trim, mask the first token, truncate; None if no target token is left."""
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
    return Encoded(np.array(tokens, np.int32), np.array(mask, bool), truncated, line, turn)


def _last_run(mask: list[bool]) -> list[bool]:
    """Only the last run of targets: the last assistant turn (a user turn's header, never a
    target, separates two assistant turns)."""
    end = len(mask) - mask[::-1].index(True) if True in mask else 0
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [start <= i < end for i in range(len(mask))]


def _render(tok, messages: list[dict], add_generation_prompt: bool, ex: Example) -> str:
    try:
        tools = {"tools": ex.tools} if ex.tools else {}
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       **tools)
    except Exception as e:  # the template's own error (raise_exception, ...): add the data line
        raise DataError(f"{ex.where}: the chat template failed on this example: {e}") from None
    _check_tools_rendered(text, messages, ex, tok)
    return text


def _tool_names(messages: list[dict], tools) -> list[str]:
    """The function names a rendering must show: each assistant tool call's, each tool's."""
    calls = [c.get("function", c).get("name") for m in messages for c in m.get("tool_calls") or ()
             if isinstance(c, dict)]
    declared = [t.get("function", t).get("name") for t in tools or () if isinstance(t, dict)]
    return [n for n in calls + declared if isinstance(n, str) and n]


def _check_tools_rendered(text: str, messages: list[dict], ex: Example, tok) -> None:
    """A template that does not know tools (SmolLM2's, say) renders a tool-calling turn as
    an empty reply and drops the tool list: training would teach the model to say nothing.
    Refuse that in one line instead."""
    for name in _tool_names(messages, ex.tools):
        if name not in text:
            raise DataError(f"{ex.where}: the chat template ({tok.template_name}) does not "
                            f"render the tool {name!r} (it has no tool calls or tool list); "
                            f"use a tool-aware template with --template FILE.jinja")


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
