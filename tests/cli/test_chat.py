"""``toygraph chat`` driven through piped stdin (a subprocess) and a pseudo-terminal; each
reply must be what greedy generation gives for the whole conversation so far."""
import io
import os
import subprocess
import sys

import pytest

from toygraph.inference.chat import chat_loop
from toygraph.gguf.templates import DEFAULT
from toygraph.inference.language_model import LanguageModel

N = 6  # new tokens per reply


def expected_replies(path, turns):
    """Greedy replies computed directly: each sees every earlier message of its session."""
    lm, replies, messages = LanguageModel(path), [], []
    for turn in turns:
        if turn == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": turn})
        # The full-window path: the CLI's default KV-cache path must give the same replies.
        replies.append(lm.generate(messages, chat=True, max_new_tokens=N, kv_cache=False))
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_chat_through_piped_stdin(tiny_llama):
    turns = ["what is that", "and what is the cat?", "/reset", "and what is the cat?"]
    stdin = "\n".join(turns + ["", "/exit", "never read"]) + "\n"
    run = subprocess.run([sys.executable, "-m", "toygraph.cli", "chat", "--model", str(tiny_llama),
                          "--max-new-tokens", str(N)], input=stdin, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    replies = expected_replies(tiny_llama, turns)
    assert run.stdout == "".join(r + "\n" for r in replies)
    assert run.stderr.count("(conversation reset)") == 1
    # History matters: the same question, asked after a turn and after /reset, gets
    # different answers from this (random) model.
    assert replies[1] != replies[2]


def test_chat_in_a_pseudo_terminal(tiny_llama):
    pty = pytest.importorskip("pty")
    pid, fd = pty.fork()
    if pid == 0:  # child: the CLI on a terminal
        os.execv(sys.executable, [sys.executable, "-m", "toygraph.cli", "chat", "--model",
                                  str(tiny_llama), "--max-new-tokens", str(N)])
    out = b""

    def read_until(marker, count=1):
        nonlocal out
        while out.count(marker) < count:
            chunk = os.read(fd, 4096)
            assert chunk, out
            out += chunk

    read_until(b">>> ")
    assert b"/reset" in out and b"/exit" in out      # the banner says how to leave
    os.write(fd, b"and what is the cat?\n")
    read_until(b">>> ", 2)
    os.write(fd, b"/exit\n")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    reply = expected_replies(tiny_llama, ["and what is the cat?"])[0]
    assert reply.strip() and reply.replace("\n", "\r\n").encode() + b"\r\n>>> " in out


def test_a_model_without_a_template_chats_in_the_default_one(tiny_llama):
    """A base model (no tokenizer.chat_template) is rendered with templates.DEFAULT, the
    format its instruction data trains in, instead of being refused."""
    lm = LanguageModel(tiny_llama)
    lm.tokenizer.file_chat_template = None
    assert lm.tokenizer.use_template(None) == DEFAULT
    prompt = lm.tokenizer.decode(lm.encode_prompt("hi", chat=True))
    assert prompt.endswith("### Instruction:\nhi\n\n### Response:\n")
    out = io.StringIO()
    assert chat_loop(lm, io.StringIO("hi\n"), out, max_new_tokens=N) == 0
    assert out.getvalue() == lm.generate("hi", chat=True, max_new_tokens=N) + "\n"


def test_chat_without_room(tiny_llama):
    # A message longer than the context is refused with a notice; the session goes on.
    lm = LanguageModel(tiny_llama)
    out, notes = io.StringIO(), io.StringIO()
    question = "and what is the cat?"
    assert chat_loop(lm, io.StringIO("the " * 200 + f"\n{question}\n"), out, notices=notes,
                     max_new_tokens=N) == 0
    assert "context" in notes.getvalue() and "/reset" in notes.getvalue()
    assert out.getvalue() == expected_replies(tiny_llama, [question])[0] + "\n"


def test_invalid_utf8_on_stdin_or_in_system_is_said_not_a_traceback(tiny_llama):
    """Undecodable bytes on stdin or in --system were a TypeError traceback."""
    cmd = [sys.executable, "-m", "toygraph.cli", "chat", "--model", str(tiny_llama),
           "--max-new-tokens", str(N)]
    run = subprocess.run(cmd, input=b"bad \xff byte\nwhat is that\n", capture_output=True,
                         timeout=300)
    assert run.returncode == 0 and b"Traceback" not in run.stderr, run.stderr
    assert b"(that line is not valid UTF-8 text (byte 0xff at character 4); it was not sent)" \
        in run.stderr
    assert run.stdout.decode() == expected_replies(tiny_llama, ["what is that"])[0] + "\n"
    run = subprocess.run([*cmd, "--system", b"be \xff".decode("utf-8", "surrogateescape")],
                         input=b"", capture_output=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count(b"\n") == 1, run.stderr
    assert b"--system is not valid UTF-8 text (byte 0xff at character 3)" in run.stderr
