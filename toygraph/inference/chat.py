"""A multi-turn conversation rendered with the model's chat template (``toygraph chat``).

>>> lm = LanguageModel("SmolLM2-135M-Instruct.Q4_1.gguf")        # doctest: +SKIP
>>> chat_loop(lm, sys.stdin, sys.stdout, max_new_tokens=128)      # doctest: +SKIP

Each input line is one user message; the reply streams out as it is generated and joins
the history, so the next turn sees the whole conversation. ``/reset`` forgets it,
``/exit`` (or end of input) ends the session. With piped input there is no prompt and
stdout holds only the replies, one after each message; notices go to stderr.
"""
from __future__ import annotations

import sys

from toygraph.bounded import terminal_text, utf8_error
from toygraph.errors import DataError

COMMANDS = {"/reset": "forget the conversation", "/exit": "leave"}


def chat_loop(lm, stdin, stdout, *, system: str | None = None, notices=None,
              **generate_kwargs) -> int:
    """Read user lines from ``stdin`` and answer each with ``lm`` until /exit or EOF."""
    notices = notices or sys.stderr

    def write(piece: str) -> None:  # the reply streams out as it is generated, escaped
        stdout.write(terminal_text(piece))
        stdout.flush()

    start = [{"role": "system", "content": system}] if system else []
    messages, interactive = list(start), stdin.isatty()
    if interactive:
        stdout.write(f"chatting with {terminal_text(lm.model.path.name)}; "
                     + ", ".join(f"{c} to {what}" for c, what in COMMANDS.items()) + "\n")
    while True:
        if interactive:
            stdout.write(">>> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            notices.write("(conversation reset)\n")
            continue
        if not text:
            continue
        why = utf8_error(line)
        if why:   # undecodable input bytes: said, and the session goes on
            notices.write(f"(that line is not valid UTF-8 text ({why}); it was not sent)\n")
            continue
        messages.append({"role": "user", "content": line.rstrip("\r\n")})
        try:
            reply = lm.generate(messages, chat=True, on_text=write, **generate_kwargs)
        except DataError as e:  # e.g. the history outgrew the context: keep the session
            messages.pop()
            notices.write(terminal_text(f"({e}; /reset to start over)\n"))
            continue
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": reply})
    return 0

