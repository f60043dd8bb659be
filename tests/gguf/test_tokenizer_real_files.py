"""Token ids of the real GGUFs the tests can get (SmolLM2: byte-level BPE; Gemma 3 270M:
262144-token sentencepiece with user-defined whitespace runs and byte fallback) equal
transformers' own GGUF tokenizer on a corpus of code, whitespace runs, tabs, newlines, many
scripts, emoji, byte-fallback characters and special tokens; decoding agrees too."""
from __future__ import annotations

import pytest

from toygraph.gguf.tokenizer import Tokenizer

CODE = '''\
import os


class Tree:
    """A node."""

    def __init__(self, left=None,  right=None):
        self.left   = left      # aligned
        self.right  = right
\tdef tabbed(self):
\t\treturn {"a": [1, 2,   3], 'b': (4,)}  # mixed\t \ttabs
'''
C_CODE = "int main(void) {\r\n\tfor (int i = 0; i < 10; ++i)\r\n\t\tprintf(\"%d\\n\", i);\r\n}\r\n"
CORPUS = [
    CODE, C_CODE,
    "    four\n        eight\n                sixteen\n" + " " * 33 + "thirty-three\n",
    "a  b   c    d     e      f" + " " * 40 + "g",
    " ", "  ", "   leading", "trailing   ", "\t", "\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\tx",
    "\n", "\n\n\n\n", "line\n \n  \n\t\n", "mixed \t \t  \n\n  \t",
    "x" + "\n" * 40 + "y",
    "Café naïve Zürich façade Ærøskøbing Łódź ğüşıöç",
    "Ελληνικά κείμενα, Русский текст, Українська мова, Српски",
    "עברית, العربية مع تشكيل: مُحَمَّد, فارسی, اردو",
    "हिन्दी, বাংলা, தமிழ், తెలుగు, ગુજરાતી, ਪੰਜਾਬੀ, සිංහල",
    "ภาษาไทย ພາສາລາວ ភាសាខ្មែរ မြန်မာ ქართული Հայերեն አማርኛ",
    "日本語のテキストとカタカナ、中文简体和繁體，한국어 문장입니다。",
    "emoji 🤗🎉👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇫🇷 ❤️ ✈︎ 1️⃣",
    "rare: \U0001D49C\U0001D4B7 \U00010348 \uE000\U000F0000 \u200b\u200d\ufeff \x00\x01\x7f \u00ad",
    "math: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∞; ½ ⅓ ¼ ① ⓐ ﬁ ﬀ Ⅻ",
    "numbers 0 7 42 1234567890 3.14159 1,000,000 1e-9 0xDEADbeef",
    "It's they'll've we'd I'M YOU'RE ain't",
    "https://example.com/path?q=a+b&x=%20#frag  user@example.org",
    "# Title\n\n* item  one\n* item\ttwo\n\n```python\nprint('hi')\n```\n| a | b |\n|---|---|\n",
    '{"key": [1, 2.5, null, true], "nested": {"s": "\\u00e9\\n"}}',
    "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn><eos>",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n  hi  <|im_end|>\n",
    "<pad><unk><mask>[multimodal]<start_of_image><|endoftext|>",
    "",
]


def _reference(path):
    """transformers' tokenizer for the GGUF. Its GGUF loader has no split for llama.cpp's
    "smollm" pre-tokenizer and falls back to GPT-2's ByteLevel regex alone; SmolLM2's own
    tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) splits digits one by one first, and
    so does llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM. The two differ where a digit follows
    spaces ("2,   3") or on numeric signs like "½", so the reference gets the model's own
    pre-tokenizer there."""
    import gguf
    from tokenizers import pre_tokenizers

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    pre = gguf.GGUFReader(path).fields.get("tokenizer.ggml.pre")
    if pre is not None and pre.contents() == "smollm":
        ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return ref


def _check_corpus(path):
    tok, ref = Tokenizer.from_gguf(path), _reference(path)
    for text in CORPUS:
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert all(0 <= i < tok.vocab_size for i in ids), text
        assert tok.encode(text) == ref.encode(text), text   # the file's BOS default too
        assert tok.decode(ids) == ref.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


@pytest.mark.reference
def test_smollm2_corpus_matches_transformers(smollm2):
    _check_corpus(smollm2)


@pytest.mark.slow
@pytest.mark.reference
def test_gemma3_270m_corpus_matches_transformers(gemma3_270m):
    # Before the fix, every run of 2+ spaces became an id past the vocabulary (262144+).
    _check_corpus(gemma3_270m)


@pytest.mark.slow
def test_gemma3_270m_whitespace_runs_are_vocabulary_tokens(gemma3_270m):
    tok = Tokenizer.from_gguf(gemma3_270m)
    assert tok.vocab_size == 262144
    for n in range(2, 32):   # "  " .. 31 spaces are tokens 138..167 of the file
        assert tok.encode(" " * n, add_bos=False) == [136 + n]
    assert tok.encode("\t\t", add_bos=False) == [tok.token_to_id("\t\t")]
    assert tok.decode(tok.encode("    if x:\n        pass", add_bos=False)) == "    if x:\n        pass"
