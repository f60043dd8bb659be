"""One example -> the token ids of a training row with its target mask.

``encode_example`` renders a chat with the model's chat template (or a plain
``### Instruction`` / ``### Response`` layout when the GGUF has none), tokenizes it exactly
as inference would, marks the assistant replies as targets and truncates to ``max_len + 1``
tokens; plain text trains on every token. ``toygraph.data`` encodes whole datasets with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from toygraph.errors import DataError
from toygraph.examples import Example

__all__ = ["Encoded", "encode_example", "FALLBACK_HEADERS"]

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
