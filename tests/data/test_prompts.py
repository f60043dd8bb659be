"""Prompt data (toygraph/data/prompts.py): parsing with file:line errors, encoding (the
chat template's generation prompt, left truncation), and prompt batches (ids in the
labels, fillers marked, repeats, order a function of seed and epoch)."""
import json

import pytest

from toygraph.data.prompts import encode_prompts, load_prompts, prompt_batches
from toygraph.errors import DataError
from toygraph.gguf.tokenizer import Tokenizer

ROWS = [{"prompt": "the cat sat on", "answer": "mat", "n": 3},
        {"prompt": [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "the capital of France?"}], "capital": "Paris"},
        {"prompt": "a dog"}]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_rows_keep_their_fields(tmp_path):
    rows = load_prompts(_write(tmp_path / "p.jsonl", ROWS))
    assert rows[0].fields == {"answer": "mat", "n": 3} and not rows[0].conversational
    assert rows[1].conversational and rows[1].fields == {"capital": "Paris"}
    assert rows[2].fields == {} and rows[2].line == 3


@pytest.mark.parametrize("row, needle", [
    ('{"question": "x"}', "p.jsonl:1: no 'prompt' (keys found: question)"),
    ('{"prompt": 3}', "p.jsonl:1: 'prompt' must be a string or a list of messages, found int"),
    ('{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "must end with a user turn"),
    ('[1]', "expected a JSON object, found list"),
])
def test_bad_rows(tmp_path, row, needle):
    with pytest.raises(DataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_prompts(_write(tmp_path / "p.jsonl", [row]))


def test_encoding_renders_chats_and_cuts_on_the_left(tmp_path, smollm2):
    tok = Tokenizer.from_gguf(smollm2)
    rows = load_prompts(_write(tmp_path / "p.jsonl", ROWS))
    ds = encode_prompts(rows, tok, max_len=64)
    chat = tok.apply_chat_template(ROWS[1]["prompt"], add_generation_prompt=True)
    assert tok.decode(ds.items[1].tokens) == chat and chat.endswith("assistant\n")
    assert ds.items[0].tokens == tok.encode("the cat sat on")
    cut = encode_prompts(rows, tok, max_len=5)
    assert cut.items[1].tokens == ds.items[1].tokens[-5:] and cut.report.truncated == 1
    assert "1 cut to their last 5 tokens" in str(cut.report)


def test_batches(tmp_path, tiny_llama):
    tok = Tokenizer.from_gguf(tiny_llama)
    items = encode_prompts(load_prompts(_write(tmp_path / "p.jsonl", ROWS)), tok, 16).items
    b = prompt_batches(items, 2, 16, 0, shuffle=False, seed=1, epoch=0)
    assert len(b) == 2
    assert b[0].labels[:, 0].tolist() == [0, 1] and b[1].labels[:, 0].tolist() == [2, 0]
    assert b[0].labels[:, 1].tolist() == [0, 0] and b[1].labels[:, 1].tolist() == [0, 1]
    assert (b[0].labels[:, 2:] == -1).all() and b[0].n_targets == 0
    assert b[0].tokens[0, :len(items[0].tokens)].tolist() == items[0].tokens
    shuffled = [prompt_batches(items, 2, 16, 0, shuffle=True, seed=1, epoch=e, repeat=2)
                for e in (0, 0, 1)]
    assert len(shuffled[0]) == 4 and shuffled[0][0] is shuffled[0][1]
    ids = [[bb.labels[:, 0].tolist() for bb in s] for s in shuffled]
    assert ids[0] == ids[1]
    with pytest.raises(DataError, match="does not fit seq_len 2"):
        prompt_batches(items, 2, 2, 0, shuffle=False, seed=1, epoch=0)
