"""Tokenizer built from GGUF metadata: SmolLM2 (byte-level BPE), a tiny sentencepiece vocab, and
tiny Qwen3-style (byte-level BPE, qwen2 split) and Gemma-3-style (sentencepiece) vocabularies with
their real chat templates.

Reference comparisons use transformers' own GGUF tokenizer loader and skip when it is absent;
the round-trip and error tests need only toygraph.
"""
from __future__ import annotations

import re

import gguf
import numpy as np

import pytest

from toygraph.errors import DataError, GGUFError
from toygraph.gguf.tokenizer import Tokenizer

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
    from toygraph.models.catalog import smollm2_path

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
def test_no_chat_template_renders_the_default_one(spm):
    """A GGUF without tokenizer.chat_template renders conversations in templates.DEFAULT
    (the Alpaca layout) instead of refusing them."""
    _, tok = spm
    assert tok.file_chat_template is None and tok.template_name == "alpaca"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True) == \
        "### Instruction:\nhi\n\n### Response:\n"


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
    with pytest.raises(DataError, match="TemplateError: no tools"):
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


# ------------------------------------------------------------------ Qwen3- and Gemma-3-style vocabularies
# Tiny vocabularies trained on multilingual prose and code (fixtures/tiny_vocab.py), in the
# layout and metadata real Qwen3 (byte-level BPE, qwen2 split) and Gemma 3 (sentencepiece,
# byte fallback, no dummy prefix) GGUFs carry.
MIXED_TEXTS = TEXTS + [
    "IT'S WE'RE I'M, it'ſſ (long s folds to s only in the (?i:) regex) and the Kelvin sign 5 K",
    "cafe\u0301 (decomposed: nobody NFC-normalizes), Ångström, déjà vu, Straße",
    "مرحبا بالعالم. שלום עולם, ירושלים. \u200fRTL mark, Привет мир",
    "🤖🎉👍🏽 ❤️ 🇫🇷 family 👨‍👩‍👧",
    "中文文本测试, 한국어 텍스트입니다",
    "12345678901234567890 then 2025-01-01, 0.000001, 1e-5",
    "class A:\n\tdef g(self):\n\t\treturn [ord(c) for c in 'abc']  # comment\n\n\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\r\n",
    " ", "  ", "\n", "\t \t", "\r\n\r\n", "        eight spaces",
    "<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|><|endoftext|>[PAD719]",
    "<bos><start_of_turn>model\nok<end_of_turn>\n<eos><pad><unk>  x<start_of_image>",
    "x<|im_start|> y<|im_end|>  z<think>w</think>",
]
SYSTEM = {"role": "system", "content": "You are terse."}
USER_1 = {"role": "user", "content": "What is 2+2?"}
REPLY_1 = {"role": "assistant", "content": "4."}
USER_2 = {"role": "user", "content": "  And 3+3? 日本 🤖  "}
REPLY_2 = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n6."}
REPLY_2R = {"role": "assistant", "content": "6.", "reasoning_content": "three and three"}
CONVERSATIONS = [
    [USER_1], [USER_1, REPLY_1], [SYSTEM, USER_1, REPLY_1], [SYSTEM, USER_1, REPLY_1, USER_2],
    [SYSTEM, USER_1, REPLY_1, USER_2, REPLY_2], [USER_1, REPLY_1, USER_2, REPLY_2R],
    [SYSTEM, USER_1, REPLY_1, USER_2, REPLY_2R, {"role": "user", "content": "ok"}],
]
THINKING = [{}, {"enable_thinking": True}, {"enable_thinking": False}]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf

    folder = tmp_path_factory.mktemp("vocab")
    return {kind: write_vocab_gguf(folder / f"{kind}.gguf", kind) for kind in ("qwen3", "gemma3")}


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def vocab(request, vocab_files):
    path = vocab_files[request.param]
    return request.param, path, Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def qwen3(vocab_files):
    return Tokenizer.from_gguf(vocab_files["qwen3"])


@pytest.fixture(scope="module")
def gemma3(vocab_files):
    return Tokenizer.from_gguf(vocab_files["gemma3"])


def _reference(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def vocab_ref(vocab):
    return _reference(vocab[1])


@pytest.mark.reference
def test_vocab_ids_match_transformers(vocab, vocab_ref):
    kind, _, tok = vocab
    for text in MIXED_TEXTS:
        assert tok.encode(text) == vocab_ref.encode(text), (kind, text)
        plain = vocab_ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_bos=False) == plain, (kind, text)
        ids = tok.encode(text)
        assert tok.decode(ids) == vocab_ref.decode(ids), (kind, text)


@pytest.mark.reference
def test_qwen3_split_matches_transformers(qwen3, vocab_files):
    # Ids alone cannot show it: the (?i:) contraction regex differs from llama.cpp's
    # expansion only on splits whose pieces no merge joins.
    ours = qwen3._hf.pre_tokenizer
    theirs = _reference(vocab_files["qwen3"]).backend_tokenizer.pre_tokenizer
    for text in MIXED_TEXTS:
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text), text


@pytest.mark.reference
def test_chat_templates_match_transformers(vocab, vocab_ref):
    from jinja2.exceptions import TemplateError

    kind, _, tok = vocab
    rendered = 0
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            for extra in THINKING:
                try:
                    ref = vocab_ref.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt, **extra)
                except TemplateError as e:  # Gemma: roles must alternate after the system turn
                    with pytest.raises(DataError, match=re.escape(str(e))):
                        tok.apply_chat_template(messages, add_generation_prompt, **extra)
                    continue
                ours = tok.apply_chat_template(messages, add_generation_prompt, **extra)
                assert ours == ref, (kind, messages, add_generation_prompt, extra)
                ref_ids = vocab_ref.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                        add_generation_prompt=add_generation_prompt, **extra)
                assert tok.encode(ours, add_bos=False) == list(ref_ids)
                rendered += 1
    assert rendered >= 24  # most conversations render for both families


@pytest.mark.reference
def test_gemma_merges_follow_file_order_not_scores(tmp_path):
    # transformers ranks a Gemma file's merges by token position; scores that disagree with
    # it (as Gemma's do) must not change the ids.
    from toygraph.fixtures.tiny_vocab import gemma3_vocab, write_vocab_gguf

    _, scores, _ = gemma3_vocab()
    shuffled = list(np.random.default_rng(0).permutation(scores))
    path = write_vocab_gguf(tmp_path / "gemma3.gguf", "gemma3", scores=[float(s) for s in shuffled])
    tok, ref = Tokenizer.from_gguf(path), _reference(path)
    for text in MIXED_TEXTS:
        assert tok.encode(text) == ref.encode(text), text


# ------------------------------------------------------------------ the same vocabularies, our code only
def test_qwen3_special_and_thinking_tokens(qwen3):
    tok = qwen3
    assert tok.add_bos_token is False and tok.eos_token == "<|im_end|>" and tok.bos_token == "<|endoftext|>"
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>")
    names = [tok.id_to_token(i) for i in ids]
    assert names[0] == "<|im_start|>" and names[-1] == "<|im_end|>"
    assert "<think>" in names and "</think>" in names
    # <think> is user-defined, not control: decoding without specials keeps it.
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nok"


def test_qwen3_template_thinking_blocks(qwen3):
    tok = qwen3
    one = tok.apply_chat_template([{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello"}])
    # The published rendering of this conversation (an empty think block on the last reply).
    assert one == ("<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n")
    prompt = tok.apply_chat_template([USER_1], add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template([USER_1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    # A reply before the last user turn loses its reasoning; the last one keeps it.
    text = tok.apply_chat_template([USER_1, REPLY_2, USER_2, REPLY_2])
    assert text.count("add them") == 1 and "<|im_start|>assistant\n6.<|im_end|>" in text


def test_gemma3_vocabulary_and_template(gemma3):
    tok = gemma3
    t = tok.token_to_id
    assert tok.add_bos_token is True and (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    # No dummy prefix; a run of spaces stored as "  " in the file is the "▁▁" piece.
    assert tok.encode("  x", add_bos=False)[0] == t("▁▁") == 16
    # A character outside the vocabulary falls back to its UTF-8 bytes.
    assert tok.encode("Ω", add_bos=False) == [t("<0xCE>"), t("<0xA9>")]
    out = tok.apply_chat_template([SYSTEM, USER_1, REPLY_1], add_generation_prompt=False)
    assert out == ("<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
                   "<start_of_turn>model\n4.<end_of_turn>\n")
    with pytest.raises(DataError, match="TemplateError: .*alternate"):
        tok.apply_chat_template([USER_1, USER_2])


def test_template_environment_extras(qwen3):
    tok = Tokenizer(qwen3._hf, qwen3._tokens, ids={"eos": qwen3.eos_id}, add_bos=False, add_eos=False,
                    chat_template="{% generation %}[{{ messages[0].content }}]{% endgeneration %}"
                                  "{{ bos_token is defined }}{{ messages[0].name is defined }}"
                                  "{{ dict(a=1) | tojson }}",
                    model="x")
    # transformers drops keys set to None and passes only the special tokens the tokenizer has.
    out = tok.apply_chat_template([{"role": "user", "content": "<b>", "name": None}])
    assert out == '[<b>]FalseFalse{"a": 1}'
    tok.chat_template = "{% set ns = namespace(_x=1) %}"
    with pytest.raises(DataError, match="SecurityError: chat templates cannot set underscore"):
        tok.apply_chat_template([])


@pytest.mark.reference
def test_template_extras_match_transformers(qwen3, vocab_files):
    import copy

    template = ("{% generation %}[{{ messages[0].content }}]{% endgeneration %}{{ bos_token is defined }}"
                "{{ unk_token is defined }}{{ messages[0].name is defined }}{{ messages[0].thinking }}"
                "{{ dict(a=1) | tojson }}{{ ['<é>'] | tojson(indent=1) }}{% for m in messages %}"
                "{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "<b>", "name": None, "reasoning": "r"},
                {"role": "assistant", "content": "ok"}]
    ref = _reference(vocab_files["qwen3"]).apply_chat_template(messages, chat_template=template,
                                                               tokenize=False)
    tok = copy.copy(qwen3)
    tok.chat_template = template
    assert tok.apply_chat_template(messages) == ref == '[<b>]TrueFalseFalser{"a": 1}[\n "<é>"\n]ok'


# ------------------------------------------------------------------ end of turn: one list
def test_end_of_turn_ids_from_vocabulary_and_metadata(tmp_path, vocab):
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf

    kind, _, tok = vocab
    expected = {"qwen3": {"<|im_end|>", "<|endoftext|>"}, "gemma3": {"<eos>", "<end_of_turn>"}}[kind]
    assert {tok.id_to_token(i) for i in tok.end_of_turn_ids} == expected
    # tokenizer.ggml.eot_token_id adds its token, whatever its spelling.
    other = 5
    tok = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "eot.gguf", kind, ids={"eot": other}))
    assert tok.eot_id == other and other in tok.end_of_turn_ids


def test_training_and_generation_stop_on_the_same_tokens(tmp_path, vocab):
    from toygraph.data.encoding import _end_of_turn_index, encode_example, Example
    from toygraph.fixtures.tiny_models import write_tiny_llama
    from toygraph.inference.language_model import LanguageModel

    # Generation stops on exactly the tokenizer's list...
    lm = LanguageModel(write_tiny_llama(tmp_path / "tiny.gguf"))
    assert lm.stop_ids == lm.tokenizer.end_of_turn_ids
    assert {lm.tokenizer.id_to_token(i) for i in lm.stop_ids} == {"<|endoftext|>", "<|im_end|>"}
    # ...and training closes a reply on a token exactly when it is in that list.
    for tok in (lm.tokenizer, vocab[2]):
        for i in range(tok.vocab_size):
            assert (_end_of_turn_index([i], tok) == 0) == (i in tok.end_of_turn_ids)
    # The reply's last target token, rendered by the real template, is one generation stops on.
    tok = vocab[2]
    enc = encode_example(Example(messages=[USER_1, REPLY_1], line=1), tok, 256)
    last_target = max(i for i, m in enumerate(enc.target_mask) if m)
    assert enc.tokens[last_target] in tok.end_of_turn_ids


# ------------------------------------------------------------------ special ids outside the vocabulary
@pytest.mark.parametrize("name,key", [("bos", "bos"), ("eos", "eos"), ("pad", "padding"),
                                      ("unk", "unknown"), ("eot", "eot")])
def test_special_id_outside_vocabulary_is_one_line_error(tmp_path, name, key):
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf

    path = write_vocab_gguf(tmp_path / "bad.gguf", "gemma3", ids={name: 100000})
    n = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "good.gguf", "gemma3")).vocab_size
    with pytest.raises(GGUFError) as e:
        Tokenizer.from_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and "bad.gguf" in msg
    assert f"tokenizer.ggml.{key}_token_id = 100000" in msg and f"vocabulary of {n} tokens" in msg


def test_gpt4o_pre_tokenizer_is_o200ks_regex():
    """gpt-oss files say tokenizer.ggml.pre = "gpt-4o": the split toygraph uses equals the
    o200k tokenizer.json regex (as llama.cpp's llama-vocab.cpp quotes it) run by the
    ``regex`` package, on text with case changes, contractions, digits, marks, newlines."""
    regex = pytest.importorskip("regex")
    from tokenizers import Regex, pre_tokenizers

    from toygraph.gguf.tokenizer import PRE_TOKENIZER_REGEXES
    o200k = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
             r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    text = ("HelloWorld it's JSONParser's 1234567 e\u0301t\u00e9  ...\n\n/usr/bin\tx  \r\n"
            "WE'LL   don't CamelCaseXML 3.14159")
    (chain,) = PRE_TOKENIZER_REGEXES["gpt-4o"]
    ours = [p for p, _ in pre_tokenizers.Split(Regex(chain), behavior="isolated")
            .pre_tokenize_str(text)]
    assert ours == regex.findall(o200k, text)
    assert "World" in ours and "456" in ours   # split at the case change, digits in threes
