"""Loss masks of tool-calling chats and prompt/completion rows (toygraph/data/encoding.py),
checked against transformers' ``apply_chat_template`` (tools included) on real tool-aware
templates: Qwen2.5's (prefix-consistent: one row per conversation) with the
``{% generation %}`` variant TRL ships for ``return_assistant_tokens_mask``, and Qwen3's
(not prefix-consistent: one row per assistant turn), both over the tiny Qwen vocabulary
(fixtures/tiny_vocab.py) that transformers loads from the same GGUF.

toygraph's targets are each assistant reply through its end-of-turn token: the "\\n" the
generation prompt ends with and the "\\n" after <|im_end|> are not targets (the first is
what the model is given, the second never reaches the loss: toygraph drops it), while
transformers' generation spans include both. Every other token agrees.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from toygraph.data.encoding import encode_rows
from toygraph.data.examples import Example
from toygraph.errors import DataError
from toygraph.gguf.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [CALL]},
             {"role": "tool", "name": "get_weather", "content": "22C, sunny"},
             {"role": "assistant", "content": "It is 22C and sunny."},
             {"role": "user", "content": "Thanks!"},
             {"role": "assistant", "content": "You're welcome."}]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "qwen.gguf", "qwen3")


@pytest.fixture(scope="module")
def ref(vocab):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name)


def tokenizer(vocab, template: str | None) -> Tokenizer:
    tok = Tokenizer.from_gguf(vocab)
    tok.use_template(str(TEMPLATES / template) if template else None)   # None: Qwen3's own
    return tok


def jinja(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def assert_masks_agree(row, ids, assistant_mask, ref):
    """``row`` is transformers' ``ids`` less the final "\\n"; its targets are transformers'
    assistant tokens less "\\n" tokens (and token 0, which nothing predicts)."""
    assert ids[-1] == ref.convert_tokens_to_ids("Ċ") and row.tokens.tolist() == ids[:-1]
    for i, (ours, theirs) in enumerate(zip(row.target_mask, assistant_mask)):
        if bool(ours) != bool(theirs):
            assert theirs and ref.decode([ids[i]]) == "\n", (i, ref.decode(ids[max(0, i - 3):i + 3]))
    assert sum(row.target_mask) > 0


@pytest.mark.reference
def test_tool_chat_mask_matches_transformers_assistant_mask(vocab, ref):
    """Qwen2.5 with tools: one row, its ids transformers' tokenization of transformers'
    rendering, its targets the generation spans of TRL's training variant."""
    tok = tokenizer(vocab, "qwen2_5.jinja")
    [row] = encode_rows(Example(messages=TOOL_CHAT, tools=[WEATHER], line=1), tok, 1024)
    text = ref.apply_chat_template(TOOL_CHAT, tools=[WEATHER], chat_template=jinja("qwen2_5.jinja"),
                                   tokenize=False)
    out = ref.apply_chat_template(TOOL_CHAT, tools=[WEATHER], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True,
                                  chat_template=jinja("qwen2_5_training.jinja"))
    assert "<tools>" in text and '"name": "get_weather"' in text   # the tools were rendered
    assert ref.decode(out["input_ids"]) == text   # the training variant renders the same text
    assert out["input_ids"] == ref.encode(text, add_special_tokens=False)
    assert_masks_agree(row, out["input_ids"], out["assistant_masks"], ref)
    targets = tok.decode([t for t, m in zip(row.tokens, row.target_mask) if m])
    assert targets == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call><|im_end|>It is 22C and sunny.<|im_end|>'
                       "You're welcome.<|im_end|>")


@pytest.mark.reference
def test_tool_chat_rows_match_transformers_prefixes_on_qwen3(vocab, ref):
    """Qwen3's template is not prefix-consistent around tool calls (the last assistant turn
    gets an empty <think> block): one row per assistant turn, each transformers' rendering
    of the turn's prompt (tools included, generation prompt on) then its reply."""
    tok = tokenizer(vocab, None)
    rows = encode_rows(Example(messages=TOOL_CHAT, tools=[WEATHER], line=1), tok, 1024)
    turns = [i for i, m in enumerate(TOOL_CHAT) if m["role"] == "assistant"]
    assert [r.turn for r in rows] == turns
    for row, i in zip(rows, turns):
        prompt = ref.apply_chat_template(TOOL_CHAT[:i], tools=[WEATHER], add_generation_prompt=True,
                                         tokenize=False)
        full = ref.apply_chat_template(TOOL_CHAT[:i + 1], tools=[WEATHER], tokenize=False)
        assert full.startswith(prompt) and full.endswith("<|im_end|>\n") and "<tools>" in prompt
        prompt_ids = ref.encode(prompt, add_special_tokens=False)
        reply_ids = ref.encode(full[len(prompt):-1], add_special_tokens=False)
        assert row.tokens.tolist() == prompt_ids + reply_ids
        assert row.target_mask.tolist() == [False] * len(prompt_ids) + [True] * len(reply_ids)
    assert "<tool_call>" in tok.decode(rows[0].tokens[rows[0].target_mask.tolist().index(True):])


@pytest.mark.reference
def test_conversational_prompt_completion_matches_trl(vocab, ref):
    """TRL's prompt-completion rows: prompt rendered with the generation prompt, prompt +
    completion rendered whole, the loss on what the completion adds (completion_mask);
    with assistant-only loss also on assistant spans (a tool result in the completion is
    no target)."""
    tok = tokenizer(vocab, "qwen2_5.jinja")
    # completion: the last reply; then the tool call, its result and the reply after it
    for prompt, completion, reply in ((TOOL_CHAT[:6], TOOL_CHAT[6:], "You're welcome."),
                                      (TOOL_CHAT[:2], TOOL_CHAT[2:5], "It is 22C and sunny.")):
        ex = Example(messages=prompt + completion, train_from=len(prompt), tools=[WEATHER], line=1)
        [row] = encode_rows(ex, tok, 1024)
        prompt_ids = ref.apply_chat_template(prompt, tools=[WEATHER], add_generation_prompt=True,
                                             tokenize=True, return_dict=True,
                                             chat_template=jinja("qwen2_5.jinja"))["input_ids"]
        out = ref.apply_chat_template(prompt + completion, tools=[WEATHER], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True,
                                      chat_template=jinja("qwen2_5_training.jinja"))
        ids = out["input_ids"]
        assert ids[:len(prompt_ids)] == prompt_ids
        completion_mask = [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
        both = [c and a for c, a in zip(completion_mask, out["assistant_masks"])]
        assert_masks_agree(row, ids, both, ref)
        trained = tok.decode([t for t, m in zip(row.tokens, row.target_mask) if m])
        assert "22C, sunny" not in trained and trained.endswith(reply + "<|im_end|>")
        assert ("<tool_call>" in trained) == (len(completion) == 3)


@pytest.mark.reference
def test_raw_prompt_completion_matches_trl(vocab, ref):
    """Strings: no template; TRL appends EOS to the completion and trains on it alone."""
    tok = tokenizer(vocab, None)
    ex = Example(prompt="The quick brown fox", completion=" jumps over the lazy dog.", line=3)
    [row] = encode_rows(ex, tok, 256)
    prompt_ids = ref(ex.prompt)["input_ids"]
    full = ref(ex.prompt + ex.completion + ref.eos_token)["input_ids"]
    assert row.tokens.tolist() == full
    assert row.target_mask.tolist() == [False] * len(prompt_ids) + [True] * (len(full) - len(prompt_ids))
    assert row.tokens[-1] == tok.eos_id
    # held compactly (a dataset keeps every row): int32 ids and a bool mask, 5 bytes a token
    assert (row.tokens.dtype, row.target_mask.dtype) == (np.int32, np.bool_)


def test_raw_completion_already_ending_in_eos_is_not_closed_twice(vocab):
    tok = tokenizer(vocab, None)
    [row] = encode_rows(Example(prompt="a", completion="b<|im_end|>", line=1), tok, 64)
    assert row.tokens.tolist().count(tok.eos_id) == 1 and row.tokens[-1] == tok.eos_id


@pytest.mark.parametrize("tools", [[WEATHER], None])
def test_a_template_that_drops_tool_calls_is_refused(vocab, tools):
    """ChatML as SmolLM2 has it knows no tools: the tool-calling turn would render as an
    empty reply (and the tool list not at all), so the row is refused, naming the tool."""
    tok = tokenizer(vocab, None)
    tok.use_template("chatml")
    with pytest.raises(DataError) as e:
        encode_rows(Example(messages=TOOL_CHAT, tools=tools, line=3), tok, 1024)
    msg = str(e.value)
    assert "\n" not in msg and ":3:" in msg and "'get_weather'" in msg and "--template" in msg


def test_a_tool_aware_template_passes_the_check(vocab):
    tok = tokenizer(vocab, "qwen2_5.jinja")
    assert encode_rows(Example(messages=TOOL_CHAT, tools=[WEATHER], line=1), tok, 1024)
