"""Chat templates that are not prefix-consistent (Qwen3): one training row per assistant turn,
each exactly what inference is given at that turn, with the reply alone as the target.
Prefix-consistent templates keep one row per conversation.

Qwen3's real template (fixtures/tiny_vocab.py, from Qwen/Qwen3-0.6B) keeps a turn's <think>
block only while no user message follows it and writes an empty one into a last turn
without reasoning, so the rendering of a conversation is not where the rendering of the
longer conversation starts. References: the expected text written out by hand, and
transformers' ``apply_chat_template`` + tokenizer loading the same GGUF.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from test_batches import FakeTokenizer, chat, targets
from toygraph.data.batches import (Example, encode_dataset, encode_example, encode_rows, load_examples,
                           split_train_val)
from toygraph.errors import DataError
from toygraph.gguf.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
USER_1 = {"role": "user", "content": "What is 2+2?"}
REPLY_1 = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."}
USER_2 = {"role": "user", "content": "And 3+3?"}
REPLY_2 = {"role": "assistant", "content": "6."}
USER_3 = {"role": "user", "content": "Thanks!"}
REPLY_3 = {"role": "assistant", "content": "<think>polite</think>You're welcome."}
CONVERSATION = [SYSTEM, USER_1, REPLY_1, USER_2, REPLY_2, USER_3, REPLY_3]

# What Qwen3's template gives at each assistant turn: the prompt (messages before the turn,
# with the generation prompt) and the reply, written out by hand.
HEAD = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
EXPECTED = [
    (2, HEAD + "<|im_start|>assistant\n",
     "<think>\nadd them\n</think>\n\n4.<|im_end|>"),
    (4, HEAD + "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
               "<|im_start|>assistant\n",
     "<think>\n\n</think>\n\n6.<|im_end|>"),
    (6, HEAD + "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
               "<|im_start|>assistant\n6.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n"
               "<|im_start|>assistant\n",
     "<think>\npolite\n</think>\n\nYou're welcome.<|im_end|>"),
]


@pytest.fixture(scope="module")
def qwen3_file(tmp_path_factory):
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "qwen3.gguf", "qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_file):
    return Tokenizer.from_gguf(qwen3_file)


def split_row(enc, tok):
    """(prompt text, target text) of a row whose targets are one run reaching its end."""
    first = enc.target_mask.tolist().index(True)
    assert all(enc.target_mask[first:]) and not any(enc.target_mask[:first])
    return tok.decode(enc.tokens[:first]), tok.decode(enc.tokens[first:])


def test_qwen3_conversation_is_one_row_per_assistant_turn(qwen3):
    rows = encode_rows(Example(messages=CONVERSATION, line=5), qwen3, 512)
    assert [(r.turn, r.line, r.truncated) for r in rows] == [(2, 5, False), (4, 5, False), (6, 5, False)]
    for row, (turn, prompt, reply) in zip(rows, EXPECTED):
        assert split_row(row, qwen3) == (prompt, reply), turn
        assert row.tokens[-1] == qwen3.eos_id  # <|im_end|>: the reply ends where generation stops


@pytest.mark.reference
def test_qwen3_rows_match_transformers(qwen3, qwen3_file):
    """Each row's ids are transformers' tokenization of transformers' rendering at that turn:
    the prompt with the generation prompt, then the reply through <|im_end|> as targets."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen3_file.parent), gguf_file=qwen3_file.name)
    conversations = [CONVERSATION, CONVERSATION[1:5], [USER_1, REPLY_2, USER_2, REPLY_1, USER_3]]
    for messages in conversations:
        rows = encode_rows(Example(messages=messages, line=1), qwen3, 512)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert [r.turn for r in rows] == turns
        for row, i in zip(rows, turns):
            prompt = ref.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
            full = ref.apply_chat_template(messages[:i + 1], tokenize=False)
            assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
            prompt_ids = ref.encode(prompt, add_special_tokens=False)
            reply_ids = ref.encode(full[len(prompt):-1], add_special_tokens=False)  # no "\n"
            assert row.tokens.tolist() == prompt_ids + reply_ids
            assert row.target_mask.tolist() == [False] * len(prompt_ids) + [True] * len(reply_ids)
            assert qwen3.decode(row.tokens) == full[:-1]


def test_prefix_consistent_templates_keep_one_row(qwen3):
    """ChatML (and Qwen3 on a single turn) stay one row, every assistant turn a target."""
    tok = FakeTokenizer()
    multi = chat(("system", "S"), ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    [row] = encode_rows(multi, tok, 256)
    assert row.turn is None and targets(row, tok) == "b<|im_end|>d<|im_end|>"
    assert encode_example(multi, tok, 256) == row
    [single] = encode_rows(Example(messages=[SYSTEM, USER_1, REPLY_1], line=2), qwen3, 256)
    assert single.turn is None and split_row(single, qwen3) == EXPECTED[0][1:]


def test_smollm2_and_gemma3_multi_turn_stay_one_row(smollm2, tmp_path):
    """Real prefix-consistent templates: one row whose targets are every reply."""
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf
    smol = Tokenizer.from_gguf(smollm2)
    gemma = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "gemma3.gguf", "gemma3"))
    plain = [USER_1, REPLY_2, USER_2, {"role": "assistant", "content": "12."}]
    for tok, end in ((smol, "<|im_end|>"), (gemma, "<end_of_turn>")):
        [row] = encode_rows(Example(messages=plain, line=1), tok, 256)
        assert row.turn is None and targets(row, tok) == f"6.{end}12.{end}"


def test_each_row_closes_with_eos_when_the_template_does_not(qwen3):
    # Upper-cases earlier assistant turns (not prefix-consistent) and closes no turn with an
    # end-of-turn token: every row's reply gets EOS, as the last reply of a one-row chat does.
    tok = FakeTokenizer(template="{% for m in messages %}{{ m.role }}: "
                                 "{% if m.role == 'assistant' and not loop.last %}{{ m.content | upper }}"
                                 "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant: {% endif %}")
    rows = encode_rows(chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")), tok, 256)
    assert [split_row(r, tok) for r in rows] == [
        ("user: a\nassistant: ", "b\n<|im_end|>"),
        ("user: a\nassistant: B\nuser: c\nassistant: ", "d\n<|im_end|>")]


def test_last_turn_only_is_the_last_row(qwen3):
    """Preference pairs train the last reply only: with Qwen3, its own row."""
    ex = Example(messages=CONVERSATION, line=3)
    last = encode_example(ex, qwen3, 512, last_turn_only=True)
    assert last == encode_rows(ex, qwen3, 512)[-1] and split_row(last, qwen3) == EXPECTED[-1][1:]


def test_preference_pairs_after_a_multi_turn_qwen3_prompt(tmp_path, qwen3):
    """DPO/ORPO pairs whose shared conversation has earlier assistant turns: each reply is
    trained after the prompt inference gives at that turn (earlier <think> dropped)."""
    from toygraph.data.preference import encode_pairs, load_pairs

    p = tmp_path / "pairs.jsonl"
    p.write_text(json.dumps({"messages": CONVERSATION[:4], "chosen": {"role": "assistant", "content": "6."},
                             "rejected": {"role": "assistant", "content": "7."}}) + "\n")
    [(chosen, rejected)] = encode_pairs(load_pairs(p), qwen3, 512).items
    assert split_row(chosen, qwen3) == EXPECTED[1][1:]
    assert split_row(rejected, qwen3) == (EXPECTED[1][1], "<think>\n\n</think>\n\n7.<|im_end|>")


def test_encode_example_refuses_a_conversation_of_several_rows(qwen3):
    with pytest.raises(DataError) as e:
        encode_example(Example(messages=CONVERSATION, line=9, path="chats.jsonl"), qwen3, 512)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("chats.jsonl:9: ") and "3 training rows" in msg
    assert "encode_rows" in msg


def test_template_that_cannot_be_split_per_turn_names_the_line(tmp_path, qwen3):
    # The generation prompt is not where the rendering of the turn starts.
    tok = FakeTokenizer(template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant says: {% endif %}")
    p = tmp_path / "d.jsonl"
    rows = [{"messages": [USER_1, REPLY_2]}, {"messages": [USER_1, REPLY_2, USER_2, REPLY_2]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        encode_dataset(load_examples(p), tok, 64)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}:1: the chat template renders the conversation "
                                              f"before messages[1]")


def test_dataset_report_counts_the_expansion(tmp_path, qwen3):
    p = tmp_path / "chats.jsonl"
    rows = [{"messages": CONVERSATION}, {"messages": [USER_1, REPLY_1]}, {"text": "plain"},
            {"messages": CONVERSATION[1:5]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = encode_dataset(load_examples(p), qwen3, 512)
    assert [(e.line, e.turn) for e in ds.items] == [(1, 2), (1, 4), (1, 6), (2, None), (3, None),
                                                  (4, 1), (4, 3)]
    r = ds.report
    assert (r.examples, r.expanded, r.expanded_rows, r.kept, r.dropped) == (4, 2, 5, 7, 0)
    assert r.target_tokens == sum(sum(e.target_mask) for e in ds.items)
    assert str(r).startswith("4 examples -> 7 rows (2 multi-turn conversations expanded into 5, "
                             "one per assistant turn: the chat template is not prefix-consistent): "
                             "7 kept,")
    # A prefix-consistent template reports as before: no expansion, no rows clause.
    plain = encode_dataset([chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))],
                           FakeTokenizer(), 64).report
    assert plain.expanded == 0 and str(plain).startswith("1 examples: 1 kept,")


def test_split_keeps_a_conversations_rows_together(qwen3):
    convs = [[USER_1, REPLY_1, USER_2, {"role": "assistant", "content": f"{i}."}] for i in range(10)]
    examples = [Example(messages=m, line=n) for n, m in enumerate(convs, start=1)]
    items = encode_dataset(examples, qwen3, 256).items
    assert len(items) == 20
    for seed in range(5):
        train, val = split_train_val(items, 0.3, seed)
        assert len(val) == 6 and len(train) == 14  # 3 of 10 conversations, 2 rows each
        assert {e.line for e in train}.isdisjoint(e.line for e in val)
        assert sorted(map(id, train + val)) == sorted(map(id, items))
        assert split_train_val(items, 0.3, seed) == (train, val)
    # Items without turns split one by one, exactly as before rows existed.
    singles = [encode_example(chat(("user", f"q{i}"), ("assistant", "a")), FakeTokenizer(), 32)
               for i in range(10)]
    train, val = split_train_val(singles, 0.3, 0)
    chosen = set(np.random.default_rng(0).permutation(10)[:3].tolist())
    assert val == [x for i, x in enumerate(singles) if i in chosen]


def test_finetune_tiny_qwen3_on_multi_turn_chats(tmp_path):
    """End to end: LoRA on a tiny qwen3 GGUF carrying Qwen3's template, multi-turn data."""
    from toygraph.fixtures.tiny_models import write_tiny_qwen3
    from toygraph.fixtures.tiny_vocab import QWEN3_TEMPLATE
    from toygraph.training import RunConfig, run_training

    model = write_tiny_qwen3(tmp_path / "q3.gguf", chat_template=QWEN3_TEMPLATE)
    data = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"say {i}"},
                          {"role": "assistant", "content": f"<think>easy</think>{i}"},
                          {"role": "user", "content": "again"},
                          {"role": "assistant", "content": f"{i} {i}"}]} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    summary = run_training(RunConfig(model=str(model), data=str(data), out=str(out),
                                       targets=("q", "v"), rank=4, alpha=8, steps=4, batch=2,
                                       seq_len=96, lr=5e-3, val_split=0.25, eval_every=2,
                                       quiet=True, seed=1))
    assert summary["status"] == "completed"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    start = events[0]
    assert start["data_report"]["expanded"] == 8 and start["data_report"]["kept"] == 16
    assert (start["train_items"], start["val_items"]) == (12, 4)  # 6 / 2 conversations
    losses = [e["loss"] for e in events if e["event"] == "step"]
    losses += [e["val_loss"] for e in events if e["event"] == "eval"]
    assert len(losses) == 4 + 3 and all(np.isfinite(losses))
