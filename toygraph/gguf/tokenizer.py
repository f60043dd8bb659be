"""A `tokenizers` tokenizer rebuilt from the vocabulary a GGUF file carries.

A GGUF has no tokenizer.json: it stores llama.cpp's view of the tokenizer as metadata
(tokens, token types, merges or scores, special ids, the name of the pre-tokenizer). We
rebuild the equivalent Hugging Face `tokenizers` pipeline from that:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The merges are in the file; the
  text is split by the regex chain llama.cpp names in ``tokenizer.ggml.pre``.
* ``tokenizer.ggml.model == "llama"`` (and Gemma 4's ``"gemma4"``, whose merges are in
  the file): a sentencepiece vocabulary. llama.cpp merges the
  adjacent pair whose concatenation has the highest score; a BPE whose merges are ranked
  by that score does the same, with ``<0xNN>`` byte fallback and "▁" for spaces. Gemma
  files rank by file order instead and spell space runs with real spaces (as transformers
  reads them), and set ``add_space_prefix`` false (no dummy "▁" in front of the text).

BOS/EOS are added in `encode` rather than by a post-processor, so the rule is in one place.
`end_of_turn_ids` is the one list of tokens that end a reply, for training and generation.
`apply_chat_template` renders the GGUF's Jinja template as transformers does.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import warnings
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import gguf
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from toygraph.bounded import printable
from toygraph.errors import DataError, GGUFError
from toygraph.gguf.reader import BoundedReader, PastEnd
from toygraph.gguf.templates import choose_template

# llama.cpp token types (llama_token_type / gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regex chains, as llama.cpp's llama-vocab.cpp lists them per `tokenizer.ggml.pre`.
# llama.cpp applies the regexes one after another, each to the pieces the previous one left,
# keeping matches and gaps alike: a chain of `Split(..., "isolated")` in `tokenizers` terms.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# The models' own tokenizer.json regexes (as transformers uses them). llama.cpp runs a hand
# expansion, (?:'[sS]|'[tT]|...), since its engine has no inline flags; the two differ only
# where Unicode case folding reaches past ASCII ("'ſ" folds to "'s").
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# gpt-oss (o200k): letters split at case changes (with marks), contractions glued on, digits
# in threes, punctuation runs keep a trailing newline or slash (llama.cpp's GPT4O chain).
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + r"?|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    # "default" is llama.cpp's chain for files whose converter did not recognise the model.
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2], "gpt2": [_GPT2], "mpt": [_GPT2], "olmo": [_GPT2], "jais": [_GPT2],
    # SmolLM2's tokenizer.json: Digits(individual_digits=True) then GPT-2's ByteLevel regex.
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2], "codeshell": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3], "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "dbrx": [_LLAMA3], "falcon3": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2], "megrez": [_QWEN2],
    # Qwen3.5: letters take their combining marks (\p{M}) along.
    "qwen35": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-4o": [_GPT4O], "llama4": [_GPT4O],
}


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    try:
        return default if f is None else f.contents()
    except UnicodeDecodeError as e:   # the file's text is not UTF-8: name the key, not a byte
        raise GGUFError(f"metadata {key!r} is not valid UTF-8 text ({e.reason} at byte "
                        f"{e.start} of one entry)") from None


def _llama_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges a sentencepiece vocabulary implies: every split of a normal token into two
    vocabulary pieces, ranked by the whole token's score (best first), the way llama.cpp's
    SPM tokenizer picks its next bigram. Ties are ordered as transformers' `generate_merges`
    orders them (longer left piece first), so both sides tokenize alike."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, score, ttype in zip(tokens, scores, types):
        if ttype not in (NORMAL, USER_DEFINED):
            continue  # control/byte/unknown tokens are never the product of a merge
        local = [(tok[:k], tok[k:], score) for k in range(1, len(tok))
                 if tok[:k] in vocab and tok[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


# Spellings that end a turn or a generation in common chat formats, besides the GGUF's own
# eos/eot/eom ids (Qwen: eos may be <|endoftext|> while turns end with <|im_end|>). llama.cpp
# stops generation on the same spellings.
END_OF_TURN_SPELLINGS = frozenset({
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>",
    "<|end_of_text|>", "<|eot|>", "<EOT>", "<|return|>", "<|call|>"})
# gpt-oss's harmony format: <|end|> closes a message inside a reply (the analysis before the
# final answer), while <|return|> ends the reply and <|call|> a tool call. A vocabulary with
# both of those does not end turns on <|end|> (llama.cpp's rule, llama-vocab.cpp).
HARMONY_ENDS, HARMONY_MESSAGE_END = frozenset({"<|return|>", "<|call|>"}), "<|end|>"
# Special ids a GGUF may name; each must index the vocabulary.
SPECIAL_ID_KEYS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown", "eot": "eot",
                   "eom": "eom"}
# Sentencepiece files whose merges follow the order of the tokens in the file rather than their
# scores, and which store runs of spaces with real spaces (transformers' gemma_tokenizer; keyed
# by general.architecture as there).
_SPM_FILE_ORDER_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


class Tokenizer:
    """Encode/decode text with the vocabulary of a GGUF file; render its chat template."""

    def __init__(self, hf: _HFTokenizer, tokens: list[str], *, ids: dict[str, int | None],
                 add_bos: bool, add_eos: bool, chat_template: str | None, model: str,
                 source: str = "<memory>"):
        self._hf = hf
        self._tokens = tokens
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (ids.get(k)
                                                              for k in ("bos", "eos", "pad", "unk"))
        self.eot_id, self.eom_id = ids.get("eot"), ids.get("eom")
        self.add_bos_token, self.add_eos_token = add_bos, add_eos
        self.model = model
        self.source = source
        # The GGUF's own template, and the one conversations are rendered with: the file's,
        # or templates.DEFAULT for a file without one, until use_template chooses another.
        self.file_chat_template = chat_template or None
        self.template_name, self.chat_template = choose_template(self, None)

    def use_template(self, choice: str | None, source: str | None = None) -> str:
        """Render conversations with template ``choice`` (a name, a Jinja file, or None for
        the model's own; see templates.py), or with ``source`` under the name ``choice``
        (the template an adapter recorded); returns the chosen template's name."""
        if source is not None:
            self.template_name, self.chat_template = choice, source
        else:
            self.template_name, self.chat_template = choose_template(self, choice)
        return self.template_name

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | gguf.GGUFReader,
                  source: str | None = None) -> "Tokenizer":
        """The tokenizer of a GGUF file (a path, or an open reader; ``source`` names the
        file in errors)."""
        if isinstance(path_or_reader, gguf.GGUFReader):
            reader = path_or_reader
            source = source or str(getattr(getattr(reader, "data", None), "filename", None)
                                   or "<GGUFReader>")
        else:
            source = str(path_or_reader)
            try:   # the bounded reader: gguf-py's trusts every count and length it reads
                reader = BoundedReader(source)
            except PastEnd as e:
                raise GGUFError(f"{source}: truncated file: {e}") from None
            except GGUFError as e:
                raise GGUFError(f"{source}: {e}") from None
            except Exception as e:  # the reader raises ValueError, KeyError, IndexError, ...
                raise GGUFError(f"{source}: cannot read GGUF file ({type(e).__name__}: "
                                f"{e})") from None

        try:
            return cls._from_reader(reader, source)
        except GGUFError as e:   # errors of the metadata helpers name the key; add the file
            if str(e).startswith(f"{source}: "):
                raise
            raise GGUFError(f"{source}: {e}") from None

    @classmethod
    def _from_reader(cls, reader, source: str) -> "Tokenizer":
        model = _field(reader, "tokenizer.ggml.model")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise GGUFError(f"{source}: no tokenizer vocabulary (tokenizer.ggml.model/.tokens missing)")
        types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise GGUFError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        ids = _special_ids(reader, len(tokens), source)
        add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
        add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))

        if model == "gpt2":
            merges = _field(reader, "tokenizer.ggml.merges")
            if not merges:
                raise GGUFError(f"{source}: gpt2 (BPE) vocabulary without tokenizer.ggml.merges")
            try:
                hf = _byte_level(tokens, merges, _field(reader, "tokenizer.ggml.pre", "default"))
            except GGUFError as e:
                raise GGUFError(f"{source}: {e}") from None
            except Exception as e:   # the tokenizers library's own words on a bad merges list
                raise GGUFError(f"{source}: tokenizer.ggml.merges cannot build a BPE "
                                f"tokenizer: {' '.join(str(e).split())}") from None
            # transformers' GPT2Tokenizer adds no BOS unless the file asks for it.
            add_bos = bool(add_bos) if add_bos is not None else False
        elif model == "llama":
            hf, spelled = _sentencepiece_from_gguf(reader, tokens, types, ids, source)
            # llama.cpp (and transformers) add BOS to a sentencepiece vocabulary by default.
            add_bos = bool(add_bos) if add_bos is not None else True
        elif model == "gemma4":
            # Gemma 4: a sentencepiece-style BPE with its merges in the file. The file says
            # add_bos_token, but the chat template writes <bos> itself: transformers adds none
            # (llama.cpp does, ggml-org/llama.cpp#21500); we follow transformers.
            hf, spelled = _sentencepiece_from_gguf(reader, tokens, types, ids, source)
            add_bos = False
        else:
            raise GGUFError(f"{source}: unsupported tokenizer.ggml.model {model!r} "
                            "(supported: gpt2, llama, gemma4)")

        # Control tokens (<|im_start|>, <s>), the unknown token and user-defined ones (<think>)
        # are matched whole in the text, as llama.cpp does; only the first two count as
        # "special" for decode skipping.
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
        # A user-defined token is added under the spelling the model's vocabulary knows it by
        # (Gemma's "  " is "▁▁" there): one absent from it would get a new id past the
        # vocabulary (transformers' add_gguf_special_tokens keeps only those in it, too).
        spelled = tokens if model == "gpt2" else spelled
        known = hf.get_vocab()
        hf.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, ty in zip(spelled, types) if ty == USER_DEFINED and t in known])
        return cls(hf, list(tokens), ids=ids, add_bos=add_bos, add_eos=add_eos,
                   chat_template=_field(reader, "tokenizer.chat_template"), model=model, source=source)

    # ---------------------------------------------------------------- encode / decode
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = False) -> list[int]:
        """Token ids of `text`. None for add_bos/add_eos means "as the GGUF says"."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos_token if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        if not 0 <= int(i) < len(self._tokens):
            raise IndexError(f"token id {i} outside vocabulary of {len(self._tokens)}")
        return self._tokens[int(i)]

    def _token(self, i: int | None) -> str | None:
        return None if i is None else self._tokens[i]

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_id)

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that close an assistant turn: the GGUF's eos, eot and eom ids and every token
        spelled as in END_OF_TURN_SPELLINGS. Training teaches the model to emit these at the
        end of a reply and generation stops on them: one list for both."""
        if not hasattr(self, "_end_of_turn_ids"):
            spelled = {i for i, t in enumerate(self._tokens) if t in END_OF_TURN_SPELLINGS}
            named = {self.eos_id, self.eot_id, self.eom_id} - {None}
            ends = spelled | named
            if HARMONY_ENDS <= {self._tokens[i] for i in ends}:
                ends = {i for i in ends if self._tokens[i] != HARMONY_MESSAGE_END}
            self._end_of_turn_ids = frozenset(ends)
        return self._end_of_turn_ids

    # ---------------------------------------------------------------- chat template
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, *,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> str:
        """Render the chat template in use (the GGUF's, or the one ``use_template`` chose) as
        transformers' ``apply_chat_template(...,
        tokenize=False)`` does: the same sandboxed environment and globals, keys whose value
        is None dropped from messages, a message's reasoning under all the names templates
        read, and the tokenizer's special tokens (those it has) as variables. Extra keyword
        arguments (``enable_thinking=False``) reach the template as variables."""
        specials = {name: tok for name, tok in (
            ("bos_token", self.bos_token), ("eos_token", self.eos_token),
            ("unk_token", self._token(self.unk_id)), ("pad_token", self._token(self.pad_id)))
            if tok is not None}
        where = f"{self.source}: the chat template ({printable(self.template_name)})"
        return render_bounded(self.chat_template, where,
                              messages=[_template_message(m) for m in messages], tools=tools,
                              documents=documents, add_generation_prompt=add_generation_prompt,
                              **{**specials, **kwargs})


def _special_ids(reader: gguf.GGUFReader, n_vocab: int, source: str) -> dict[str, int | None]:
    """The special token ids the file names, each checked to index the vocabulary."""
    ids = {}
    for name, key in SPECIAL_ID_KEYS.items():
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None and not 0 <= int(value) < n_vocab:
            raise GGUFError(f"{source}: tokenizer.ggml.{key}_token_id = {value} is outside the "
                            f"vocabulary of {n_vocab} tokens")
        ids[name] = None if value is None else int(value)
    return ids


def _sentencepiece_from_gguf(reader: gguf.GGUFReader, tokens: list[str], types: list[int],
                             ids: dict[str, int | None], source: str) -> tuple[_HFTokenizer, list[str]]:
    """The tokenizer, and the tokens as its vocabulary spells them."""
    merges = _field(reader, "tokenizer.ggml.merges")
    scores = _field(reader, "tokenizer.ggml.scores")
    if not merges and not scores:
        raise GGUFError(f"{source}: llama (sentencepiece) vocabulary without scores or merges")
    prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    if _field(reader, "general.architecture") in _SPM_FILE_ORDER_ARCHS:
        # A token made of spaces is stored with real spaces, while text reaches the model
        # with every space as "▁": spell it that way, or it could never be matched.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    unk = tokens[ids["unk"]] if ids["unk"] is not None else None
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges
             else _llama_merges(tokens, scores, types))
    return _sentencepiece(tokens, pairs, unk, prefix if prefix is not None else True), tokens


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to a template: keys set to None removed (templates
    test ``is defined``), and reasoning under ``reasoning_content`` and ``thinking`` both."""
    message = {k: v for k, v in message.items() if v is not None}
    names = ("reasoning_content", "thinking", "reasoning")
    reasoning = next((message[k] for k in names if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _byte_level(tokens: list[str], merges: list[str], pre: str) -> _HFTokenizer:
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        # Unknown name: GPT-2's split is the common ancestor of nearly all of them; ids may
        # differ from llama.cpp on digit runs and whitespace for such a model.
        warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}: splitting text with GPT-2's regex")
        regexes = [_GPT2]
    # A spelling listed twice maps to its last id, as in llama.cpp's token_to_id and transformers.
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 ignore_merges=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece(tokens: list[str], merges: list[tuple[str, str]], unk: str | None,
                   add_prefix_space: bool) -> _HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    # Spaces become "▁" and, like sentencepiece's add_dummy_prefix, a "▁" goes in front of
    # the text. As a normalizer (not transformers' Metaspace pre-tokenizer) this matches
    # llama.cpp and sentencepiece in two places transformers differs: " hi" keeps both
    # spaces ("▁▁hi", Metaspace skips the prefix when the text already starts with one), and
    # text right after a special token gets its own prefix (normalizers run per segment).
    steps = [normalizers.Replace(" ", "▁")]
    if add_prefix_space:
        steps.insert(0, normalizers.Prepend("▁"))
    hf.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))  # drop the dummy prefix again
    hf.decoder = decoders.Sequence(steps)
    return hf


_TEMPLATES: dict[str, Any] = {}

# A chat template is code from the internet: bounded in size, in time and in what it writes.
MAX_TEMPLATE_CHARS = 1 << 20          # real ones are under 20 KB
RENDER_SECONDS = 10.0                 # one rendering; a conversation takes milliseconds
MAX_RENDER_CHARS = 16 << 20           # what one rendering may write (and one * may make)


class TemplateTimeout(Exception):
    """A chat template ran past RENDER_SECONDS."""


def _template_line(tb) -> int | None:
    """The template's line an exception was raised at (jinja runs templates as code whose
    frames say <template>), or None."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@contextmanager
def _deadline(seconds: float):
    """Raise TemplateTimeout in the main thread after ``seconds`` (SIGALRM); elsewhere a
    no-op, since only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TemplateTimeout()
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def render_bounded(source: str, where: str, **context) -> str:
    """Render chat template ``source`` within MAX_TEMPLATE_CHARS, RENDER_SECONDS and
    MAX_RENDER_CHARS; any failure (syntax, undefined, security, recursion, overflow, a
    loop that does not end, a string that does not stop growing) is one DataError naming
    ``where`` and the template's line."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise DataError(f"{where} is {len(source):,} characters; templates over "
                        f"{MAX_TEMPLATE_CHARS:,} are refused")
    out, size = [], 0
    try:
        with _deadline(RENDER_SECONDS):
            for chunk in _compile(source).generate(**context):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise DataError(f"{where} wrote more than {MAX_RENDER_CHARS:,} characters "
                                    f"for one conversation")
                out.append(chunk)
    except DataError:
        raise
    except TemplateTimeout:
        raise DataError(f"{where} ran for more than {RENDER_SECONDS:g}s on one conversation "
                        f"(a loop that does not end?)") from None
    except (Exception, RecursionError) as e:   # jinja's errors and the template's own
        line = getattr(e, "lineno", None) or _template_line(e.__traceback__)
        at = f" line {line}" if line else ""
        # a template's raise_exception text is the file's: escaped, never sent raw
        message = printable(" ".join(str(e).split())[:300]) or type(e).__name__
        raise DataError(f"{where}{at}: {type(e).__name__}: {message}") from None
    return "".join(out)


def _compile(source: str):
    """Compile a chat template once, in the environment transformers uses for them
    (utils/chat_template_utils.py): sandboxed, trim_blocks/lstrip_blocks, loop controls,
    `{% generation %}` blocks, raise_exception, strftime_now, an HTML-safe-free tojson, and
    `namespace`/`dict` that refuse underscore names."""
    if source not in _TEMPLATES:
        from jinja2 import nodes
        from jinja2.exceptions import SecurityError, TemplateError
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2.utils import Namespace

        class Generation(Extension):
            # transformers marks assistant text with {% generation %}...{% endgeneration %} for
            # its token mask; the rendered text is the block's body either way.
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        class TemplateNamespace(Namespace):
            def __init__(*args, **kwargs):  # Namespace's own signature trick, kept
                self, attrs = args[0], dict(*args[1:], **kwargs)
                for name in attrs:
                    TemplateNamespace._check(name)
                Namespace.__init__(self, attrs)

            def __setitem__(self, name, value):
                TemplateNamespace._check(name)
                Namespace.__setitem__(self, name, value)

            @staticmethod
            def _check(name):
                if isinstance(name, str) and name.startswith("_"):
                    raise SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

        class TemplateDict:  # `dict(...)` and `dict.fromkeys(...)`, without the type itself
            def __call__(self, *args, **kwargs):
                return dict(*args, **kwargs)

            def fromkeys(self, *args, **kwargs):
                return dict.fromkeys(*args, **kwargs)

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # HF's tojson: no HTML escaping (jinja's builtin escapes <, >, &, ').
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        class BoundedEnvironment(ImmutableSandboxedEnvironment):
            # the sandbox's hook for operators: "x" * 10**9 and 10 ** 10**9 are refused
            # before they are computed, not after the machine's memory is gone
            intercepted_binops = frozenset(["*", "**"])

            def call_binop(self, context, operator, left, right):
                if operator == "**" and isinstance(right, int) and abs(right) > 1024:
                    raise SecurityError(f"the exponent {right} is too large")
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                                and len(seq) * n > MAX_RENDER_CHARS:
                            raise SecurityError(f"a {type(seq).__name__} repeated {n} times is "
                                                f"too large")
                return super().call_binop(context, operator, left, right)

        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                 extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["namespace"] = TemplateNamespace
        env.globals["dict"] = TemplateDict()
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
