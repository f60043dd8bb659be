"""Tokenizer built from GGUF metadata: SmolLM2 (byte-level BPE) and a tiny sentencepiece vocab.

Reference comparisons use transformers' own GGUF tokenizer loader and skip when it is absent;
the round-trip and error tests need only toygraph.
"""
from __future__ import annotations

import gguf
import pytest

from toygraph.errors import DataError, GGUFError
from toygraph.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they'll've gone!",
    "Café, naïve, Zürich, São Paulo — 日本語のテキスト, 中文, 한국어 🤖🎉👍🏽",
    "12345678 and 3.14159, 1,000,000 and 0x1F",
    "a  b   c\t\td\n\n\ne   ",
    "   leading spaces and trailing\n \n",
    "def f(x):\n    if x > 0:\n        return x ** 2\n    return -x\n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]


@pytest.fixture(scope="module")
def smollm2():
    from toygraph.fixtures.smollm2 import smollm2_path

    path = smollm2_path()
    return path, Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def smollm2_ref(smollm2):
    transformers = pytest.importorskip("transformers")
    path, _ = smollm2
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ------------------------------------------------------------------ SmolLM2, our code only
def test_smollm2_metadata(smollm2):
    _, tok = smollm2
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smollm2, text):
    _, tok = smollm2
    assert tok.decode(tok.encode(text)) == text


def test_smollm2_special_tokens_single_id(smollm2):
    _, tok = smollm2
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_smollm2_bos_eos_flags(smollm2):
    _, tok = smollm2
    plain = tok.encode("hi")
    assert tok.add_bos_token is False  # the file says so; GPT-2 style adds none by default
    assert tok.encode("hi", add_bos=True) == [tok.bos_id] + plain
    assert tok.encode("hi", add_eos=True) == plain + [tok.eos_id]


def test_smollm2_digits_split_individually(smollm2):
    # "smollm" pre-tokenizer: every digit is its own piece (SmolLM2's Digits(individual_digits)).
    _, tok = smollm2
    ids = tok.encode("12345678")
    assert [tok.decode([i]) for i in ids] == list("12345678")


def test_smollm2_chat_template_renders(smollm2):
    _, tok = smollm2
    out = tok.apply_chat_template(CONVERSATION[1:], add_generation_prompt=True)
    # No system message: the template inserts its default one.
    assert out.startswith("<|im_start|>system\n") and out.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ SmolLM2 vs transformers
@pytest.mark.reference
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_match_transformers(smollm2, smollm2_ref, text):
    _, tok = smollm2
    assert tok.encode(text, add_bos=False) == smollm2_ref.encode(text, add_special_tokens=False)
    # Defaults agree too: the file's add_bos_token is false, and neither side adds one.
    assert tok.encode(text) == smollm2_ref.encode(text)


@pytest.mark.reference
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_smollm2_chat_template_matches_transformers(smollm2, smollm2_ref, add_generation_prompt):
    _, tok = smollm2
    for messages in (CONVERSATION, CONVERSATION[1:]):
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        ref = smollm2_ref.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
        assert ours == ref


# ------------------------------------------------------------------ tiny sentencepiece vocab
SPM_PIECES = [  # (piece, score): sentencepiece scores, higher merges first
    ("▁", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("w", -2.0), ("r", -2.0),
    ("d", -2.0), ("a", -2.0), ("t", -2.0),
    ("ll", -3.0), ("he", -3.5), ("▁h", -4.0), ("llo", -5.0), ("hello", -6.0), ("▁hello", -6.5),
    ("or", -7.0), ("▁w", -7.5), ("▁wor", -8.0), ("ld", -8.5), ("▁world", -9.0), ("▁▁", -9.5),
    ("at", -10.0), ("▁t", -10.5), ("▁th", -11.0),
]


def write_spm_gguf(path, *, add_bos=None, chat_template=None):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in SPM_PIECES]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [s for _, s in SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_TEXTS = ["hello world", "hello  world", "héllo wörld\n", "what", "that hello ", "", "xyz 🤖"]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
    return path, Tokenizer.from_gguf(path)


def test_spm_basics(spm):
    _, tok = spm
    t = tok.token_to_id
    assert tok.add_bos_token is True  # no flag in the file: sentencepiece vocabularies add BOS
    assert tok.encode("hello world") == [1, t("▁hello"), t("▁world")]
    # A byte missing from the vocabulary falls back to its <0xNN> tokens; "é" is C3 A9.
    ids = tok.encode("é", add_bos=False)
    assert ids == [t("▁"), t("<0xC3>"), t("<0xA9>")]
    assert tok.encode("<s>", add_bos=False) == [1]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_round_trip(spm, text):
    _, tok = spm
    for t in (text, " " + text):
        assert tok.decode(tok.encode(t), skip_special_tokens=True) == t
        assert tok.decode(tok.encode(t, add_bos=False)) == t


def test_spm_prefix_space_as_llama_cpp(spm):
    # The two places we follow sentencepiece/llama.cpp rather than transformers' GGUF loader
    # (whose Metaspace pre-tokenizer gives [1, ▁hello] and no prefix after "<s>"):
    _, tok = spm
    t = tok.token_to_id
    # 1. Leading space: the dummy prefix is added anyway, so the space survives a round trip.
    assert tok.encode(" hello") == [1, t("▁"), t("▁hello")]
    # 2. Text after a special token gets its own dummy prefix (llama.cpp's is_prev_special).
    assert tok.encode("at<s>hello", add_bos=False) == [t("▁"), t("at"), 1, t("▁hello")]


@pytest.mark.reference
@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_matches_transformers(spm, text):
    transformers = pytest.importorskip("transformers")
    path, tok = spm
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok.encode(text) == ref.encode(text)
    assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == ref.decode(ids)


# ------------------------------------------------------------------ errors and templates
def test_no_chat_template_is_data_error(spm):
    _, tok = spm
    with pytest.raises(DataError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_environment(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
        "  [{{ m['role'] }}] {{ m['content'] | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "t.gguf", add_bos=False, chat_template=template))
    assert tok.add_bos_token is False and tok.encode("hello")[0] != tok.bos_id
    out = tok.apply_chat_template([{"role": "user", "content": "<hé>"}], add_generation_prompt=True)
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent before one;
    # tojson does not HTML-escape or ASCII-escape.
    assert out == '<s>  [user] "<hé>"\n[assistant]'
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_vocab_is_gguf_error(tmp_path):
    path = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="novocab.gguf"):
        Tokenizer.from_gguf(path)
    with pytest.raises(GGUFError, match="novocab.gguf"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


def test_unsupported_model_is_gguf_error(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_gguf(path)
