"""Tests for toygraph/data/batches.py: parsing, masks, truncation, batching, splitting."""
from __future__ import annotations

import json
import re

import jinja2
import numpy as np
import pytest

from toygraph.demo.capitals import data_path as capitals_data
from toygraph.data.batches import (Batch, Example, batches, data_hash, encode_dataset, encode_example,
                           load_examples, pad_id_for, split_train_val, steps_per_epoch)
from toygraph.errors import DataError
from toygraph.gguf.templates import DEFAULT, TEMPLATES

CAPITALS = capitals_data()
CHATML = ("{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A Llama-3-like template that renders BOS itself, for a tokenizer that also adds BOS.
WITH_BOS = ("{{ bos_token }}{% for m in messages %}{{ '<|start|>' + m['role'] + '\n' + m['content'] "
            "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\n' }}{% endif %}")


class FakeTokenizer:
    """Byte-level tokenizer with whole-string special tokens: the Tokenizer interface in
    miniature, so the masking logic is tested without a GGUF."""
    SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "<|start|>", "<|eot_id|>"]

    def __init__(self, template=CHATML, bos_id=None, eos_id=2, pad_id=None, add_bos=False):
        # As Tokenizer: a GGUF without a template is rendered with templates.DEFAULT.
        self.chat_template = template if template is not None else TEMPLATES[DEFAULT]
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos
        self.vocab_size = 16 + 256
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    def encode(self, text, add_bos=None, add_eos=False):
        ids = []
        for piece in self._split.split(text):
            if piece in self.SPECIALS:
                ids.append(self.SPECIALS.index(piece))
            else:
                ids += [16 + b for b in piece.encode("utf-8")]
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @property
    def end_of_turn_ids(self):
        # As Tokenizer.end_of_turn_ids: eos plus the turn-ending spellings in the vocabulary.
        ends = {self.SPECIALS.index(t) for t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>")}
        return frozenset(ends | ({self.eos_id} - {None}))

    def decode(self, ids, skip_special_tokens=False):
        out, buf = [], b""
        for i in ids:
            if i >= 16:
                buf += bytes([i - 16])
                continue
            out.append(buf.decode("utf-8", "replace"))
            buf = b""
            if not skip_special_tokens:
                out.append(self.SPECIALS[i])
        return "".join(out) + buf.decode("utf-8", "replace")

    def apply_chat_template(self, messages, add_generation_prompt=False):
        bos = self.SPECIALS[self.bos_id] if self.bos_id is not None else ""
        eos = self.SPECIALS[self.eos_id] if self.eos_id is not None else ""
        return jinja2.Template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
            eos_token=eos)


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def targets(enc, tok):
    return tok.decode([t for t, m in zip(enc.tokens, enc.target_mask) if m])


def chat(*turns):
    return Example(messages=[{"role": r, "content": c} for r, c in turns], line=1)


# ------------------------------------------------------------------------- parsing
def test_every_shape_parses(tmp_path):
    p = write(tmp_path, [
        json.dumps({"instruction": "Hi?", "response": "Hello.", "system": "Be brief."}),
        "",
        json.dumps({"instruction": "Add", "input": "1 2", "output": "3"}),
        json.dumps({"instruction": "Say x", "input": "", "output": "x"}),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                 {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}),
        "   ",
        json.dumps({"text": "plain text"}),
    ])
    exs = load_examples(p)
    assert [e.line for e in exs] == [1, 3, 4, 5, 7]
    assert exs[0].messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    assert exs[1].messages[0] == {"role": "user", "content": "Add\n\n1 2"}
    assert exs[1].messages[1] == {"role": "assistant", "content": "3"}
    assert exs[2].messages[0]["content"] == "Say x"
    assert len(exs[3].messages) == 4 and exs[3].text is None
    assert exs[4].text == "plain text" and exs[4].messages is None


@pytest.mark.parametrize("line, needle", [
    ('{"instruction": "x", "response": ', "invalid JSON"),
    ('{"prompt": "x", "chosen": "y"}', "needs a 'completion'"),
    ('[1, 2]', "expected a JSON object"),
    ('{"instruction": 5, "response": "y"}', "'instruction' must be a string"),
    ('{"instruction": "x", "output": null}', "'output' must be a string"),
    ('{"text": ["a"]}', "'text' must be a string"),
    ('{"instruction": "x"}', "'response' or 'output'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}', "content must be a string"),
    ('{"messages": "hello"}', "non-empty list"),
    ('{"messages": [], "text": "x"}', "ambiguous"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, needle):
    p = write(tmp_path, ['{"text": "ok"}', "", line])
    with pytest.raises(DataError) as e:
        load_examples(p)
    assert f"{p}:3" in str(e.value) and needle in str(e.value)


def test_unknown_shape_lists_accepted_shapes(tmp_path):
    p = write(tmp_path, ['{"question": "q", "answer": "a"}'])
    with pytest.raises(DataError, match=r"keys found: answer, question.*accepted shapes.*messages"):
        load_examples(p)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_examples(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no examples"):
        load_examples(write(tmp_path, ["", "  "]))


# ------------------------------------------------------------------------- masks
def test_mask_covers_assistant_content_and_end_of_turn():
    tok = FakeTokenizer()
    enc = encode_example(chat(("user", "What is 2+2?"), ("assistant", "4, obviously.")), tok, 256)
    assert targets(enc, tok) == "4, obviously.<|im_end|>"
    assert tok.decode(enc.tokens).endswith("<|im_start|>assistant\n4, obviously.<|im_end|>")
    assert enc.tokens.tolist().count(1) == 3  # <|im_start|> encoded as one id each time
    assert not enc.truncated and enc.line == 1


def test_multi_turn_every_assistant_turn_is_a_target():
    tok = FakeTokenizer()
    enc = encode_example(chat(("system", "S"), ("user", "a"), ("assistant", "b"),
                              ("user", "c"), ("assistant", "d"), ("user", "ignored tail")), tok, 256)
    assert targets(enc, tok) == "b<|im_end|>d<|im_end|>"
    assert "ignored tail" not in tok.decode(enc.tokens)


def test_template_bos_is_not_doubled_and_turn_end_is_not_followed_by_eos():
    tok = FakeTokenizer(template=WITH_BOS, bos_id=3, eos_id=0, add_bos=True)
    enc = encode_example(chat(("user", "hi"), ("assistant", "yo")), tok, 256)
    assert enc.tokens[0] == 3 and enc.tokens.tolist().count(3) == 1
    assert targets(enc, tok) == "yo<|eot_id|>"  # <|eot_id|> ends the turn; no extra EOS


def test_eos_added_when_template_does_not_close_the_turn():
    tok = FakeTokenizer(template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant: {% endif %}")
    enc = encode_example(chat(("user", "hi"), ("assistant", "yo")), tok, 256)
    assert targets(enc, tok) == "yo\n<|im_end|>"


def test_the_default_template_of_a_model_without_one():
    """templates.DEFAULT (Alpaca's headers, EOS after each reply) renders what the
    hand-written fallback of 0.1 produced, token for token."""
    tok = FakeTokenizer(template=None)
    enc = encode_example(chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")), tok, 256)
    assert tok.decode(enc.tokens) == ("### Instruction:\na\n\n### Response:\nb<|im_end|>"
                                      "\n\n### Instruction:\nc\n\n### Response:\nd<|im_end|>")
    assert targets(enc, tok) == "b<|im_end|>d<|im_end|>"


def test_template_that_is_not_incremental_is_an_error():
    # Renders the last message differently from earlier ones, so prefixes do not line up.
    tok = FakeTokenizer(template="{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]"
                                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(DataError, match=r":7: the chat template renders"):
        encode_example(Example(messages=[{"role": "user", "content": "a"},
                                         {"role": "assistant", "content": "b"}], line=7, path="f"), tok, 64)


def test_plain_text_every_token_is_a_target():
    tok = FakeTokenizer(bos_id=3, add_bos=True)
    enc = encode_example(Example(text="abc", line=1), tok, 64)
    assert enc.tokens.tolist() == [3, 16 + 97, 16 + 98, 16 + 99, 2]
    assert enc.target_mask.tolist() == [False, True, True, True, True]


# ------------------------------------------------------------------------- truncation
def test_truncation_keeps_prompt_tail_and_response_head():
    tok = FakeTokenizer()
    ex = chat(("user", "P" * 100), ("assistant", "R" * 100))
    enc = encode_example(ex, tok, 40)
    assert enc.truncated and len(enc.tokens) == 41
    got = targets(enc, tok)
    assert got and got == "R" * len(got)  # head of the response
    assert tok.decode(enc.tokens).startswith("P")  # tail of the prompt
    # A short response survives whole behind a long prompt.
    enc = encode_example(chat(("user", "P" * 100), ("assistant", "ok")), tok, 40)
    assert enc.truncated and targets(enc, tok) == "ok<|im_end|>"
    ds = encode_dataset([ex, chat(("user", "q"), ("assistant", "a"))], tok, 64)
    assert ds.report.truncated == 1 and ds.report.kept == 2 and ds.report.dropped == 0
    assert ds.report.target_tokens == sum(sum(e.target_mask) for e in ds.items)
    assert "1 truncated" in str(ds.report)


def test_example_without_targets_is_dropped_and_counted():
    tok = FakeTokenizer(eos_id=None)
    ds = encode_dataset([Example(text="", line=4), Example(text="ab", line=5)], tok, 8)
    assert ds.report.dropped == 1 and ds.report.dropped_lines == [4] and len(ds.items) == 1


# ------------------------------------------------------------------------- batching, splitting
def _items(n):
    tok = FakeTokenizer()
    return [encode_example(chat(("user", f"q{i}"), ("assistant", "a" * (i % 5))), tok, 48) for i in range(n)]


def test_batches_static_shapes_padding_and_labels():
    items = _items(7)
    bs = batches(items, 3, 48, pad_id=0, shuffle=False, seed=0, epoch=0)
    assert len(bs) == steps_per_epoch(7, 3) == 3
    for b in bs:
        assert isinstance(b, Batch)
        for a in (b.tokens, b.positions, b.labels):
            assert a.shape == (3, 48) and a.dtype == np.int32
        assert (b.positions == np.arange(48)).all()
        assert b.n_targets == int((b.labels != -1).sum())
    last = bs[-1]
    assert (last.labels[1:] == -1).all() and (last.tokens[1:] == 0).all()  # filler rows
    first = items[0]
    n = len(first.tokens) - 1
    assert bs[0].tokens[0, :n].tolist() == first.tokens[:-1].tolist()
    expect = [t if m else -1 for t, m in zip(first.tokens[1:], first.target_mask[1:])]
    assert bs[0].labels[0, :n].tolist() == expect
    assert (bs[0].labels[0, n:] == -1).all() and (bs[0].tokens[0, n:] == 0).all()


def test_batch_order_is_a_function_of_seed_and_epoch():
    items = _items(20)
    def order(seed, epoch):
        return np.concatenate([b.tokens for b in batches(items, 4, 48, 0, shuffle=True, seed=seed, epoch=epoch)])
    assert (order(1, 0) == order(1, 0)).all()
    assert not (order(1, 0) == order(1, 1)).all()
    assert sorted(map(tuple, order(1, 1).tolist())) == sorted(map(tuple, order(1, 0).tolist()))


def test_too_long_item_is_an_error():
    with pytest.raises(DataError, match="do not fit seq_len"):
        batches(_items(2), 1, 4, 0, shuffle=False, seed=0, epoch=0)


def test_split_is_disjoint_and_deterministic():
    items = list(range(50))
    train, val = split_train_val(items, 0.1, seed=3)
    assert len(val) == 5 and sorted(train + val) == items and not set(train) & set(val)
    assert split_train_val(items, 0.1, seed=3) == (train, val)
    assert split_train_val(items, 0.1, seed=4)[1] != val
    assert split_train_val(items, 0.0, seed=3) == (items, [])
    assert len(split_train_val([1, 2], 0.01, seed=0)[1]) == 1


def test_pad_id_and_hash(tmp_path):
    assert pad_id_for(FakeTokenizer(pad_id=7)) == 7
    assert pad_id_for(FakeTokenizer(eos_id=2)) == 2
    assert pad_id_for(FakeTokenizer(eos_id=None)) == 0
    p = write(tmp_path, ['{"text": "x"}'])
    assert data_hash(p) == data_hash(p) and len(data_hash(p)) == 64
    p.write_text('{"text": "y"}\n')
    assert data_hash(p) != data_hash(write(tmp_path, ['{"text": "x"}'], "e.jsonl"))


def test_capitals_fixture_loads():
    exs = load_examples(CAPITALS)
    assert len(exs) >= 300
    from toygraph.demo.capitals import parse
    assert all(set(parse(e.messages[-1]["content"])) == {"country", "capital"} for e in exs)


# ------------------------------------------------------------------------- real SmolLM2 tokenizer
@pytest.fixture(scope="module")
def smollm2_tok(smollm2):
    from toygraph.gguf.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2)


def test_smollm2_mask_decodes_to_response_and_end_of_turn(smollm2_tok):
    tok = smollm2_tok
    response = '{"country": "Peru", "capital": "Lima"}'
    enc = encode_example(chat(("user", "What is the capital of Peru?"), ("assistant", response)), tok, 128)
    assert targets(enc, tok) == response + "<|im_end|>"
    text = tok.decode(enc.tokens)
    assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>") == 3
    im_start = tok.encode("<|im_start|>", add_bos=False)
    assert len(im_start) == 1 and enc.tokens.tolist().count(im_start[0]) == 3
    multi = encode_example(chat(("user", "a"), ("assistant", "b c"), ("user", "d"), ("assistant", "e")), tok, 128)
    assert targets(multi, tok) == "b c<|im_end|>e<|im_end|>"


def test_smollm2_capitals_fit_and_truncate(smollm2_tok):
    ds = encode_dataset(load_examples(CAPITALS), smollm2_tok, 64)
    assert ds.report.kept == ds.report.examples and ds.report.dropped == 0
    assert all(len(e.tokens) <= 65 and any(e.target_mask) for e in ds.items)
    enc = encode_example(chat(("user", "word " * 200), ("assistant", "x " * 200)), smollm2_tok, 32)
    assert enc.truncated and len(enc.tokens) == 33 and 0 < sum(enc.target_mask) < 33


# --- hostile files: each a one-line DataError with the line, in bounded time and memory -----
def test_lone_surrogates_and_non_utf8_name_the_line(tmp_path):
    p = write(tmp_path, ['{"text": "fine"}', '{"text": "half a pair \\ud83d here"}'])
    with pytest.raises(DataError, match=r"d.jsonl:2: 'text' holds a lone surrogate \(\\ud83d"):
        load_examples(p)
    bad = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\udc00"}]}'
    with pytest.raises(DataError, match=r"d.jsonl:1: messages\[1\].content holds a lone surrogate"):
        load_examples(write(tmp_path, [bad]))
    raw = tmp_path / "latin1.jsonl"
    raw.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8"):
        load_examples(raw)


def test_deep_nesting_is_refused_before_parsing(tmp_path):
    deep = '{"text": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(DataError, match=r"d.jsonl:1: JSON nested 100001 levels deep"):
        load_examples(write(tmp_path, [deep]))
    # Brackets inside strings are text, not nesting.
    ok = load_examples(write(tmp_path, [json.dumps({"text": "[" * 500 + "{" * 500})]))
    assert ok[0].text.startswith("[[[")


def test_an_overlong_line_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    import toygraph.data.examples
    monkeypatch.setattr(toygraph.data.examples, "MAX_LINE_BYTES", 1000)
    p = write(tmp_path, ['{"text": "short"}', json.dumps({"text": "a" * 5000}), '{"text": "after"}'])
    with pytest.raises(DataError, match=r"d.jsonl:2: line longer than"):
        load_examples(p)
    # At the limit itself the line is fine (the newline does not count against it).
    assert len(load_examples(write(tmp_path, [json.dumps({"text": "a" * 980})]))) == 1
