"""Next-token choice from logits, and text streamed out of generated tokens.

>>> opts = SamplingOptions(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=1)
>>> rng = opts.rng()
>>> pick_token(logits, context_ids, opts, rng)                      # doctest: +SKIP
42

The filters follow transformers' definitions and order: the repetition penalty (CTRL's:
a positive logit of a token already in the context is divided by the penalty, a negative
one multiplied), then temperature, then top-k, top-p and min-p on the tempered
distribution. Temperature 0 is greedy (argmax after the penalty).
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np

from toygraph.cpu import engine
from toygraph.errors import DataError


@dataclass(frozen=True)
class SamplingOptions:
    """How to choose each next token. Defaults are greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    min_p: float = 0.0              # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        checks = [("temperature", 0 <= self.temperature < math.inf), ("top_k", self.top_k >= 0),
                  ("top_p", 0 < self.top_p <= 1), ("min_p", 0 <= self.min_p <= 1),
                  ("repetition_penalty", 0 < self.repetition_penalty < math.inf)]
        for name, ok in checks:
            if not ok:
                raise DataError(f"{name}={getattr(self, name)!r} is out of range "
                                "(finite: temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                                "0 <= min_p <= 1, repetition_penalty > 0)")

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def apply_repetition_penalty(logits: np.ndarray, context_ids, penalty: float) -> np.ndarray:
    """CTRL / transformers: for every distinct token already in the context, a positive
    logit is divided by ``penalty`` and a negative one multiplied by it."""
    out = np.array(logits, np.float64)
    if penalty != 1.0 and len(context_ids):
        seen = np.unique(np.asarray(context_ids, np.int64))
        out[seen] = np.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
    return out


def top_k_filter(z: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits (and any tied with the k-th); others become -inf."""
    if k <= 0 or k >= z.size:
        return z
    return np.where(z < np.partition(z, -k)[-k], -np.inf, z)


def top_p_filter(z: np.ndarray, p: float) -> np.ndarray:
    """Nucleus: keep the smallest set of most probable tokens whose mass reaches ``p``."""
    if p >= 1.0:
        return z
    order = np.argsort(-z, kind="stable")
    mass = np.cumsum(softmax(z)[order])
    n_keep = int(np.searchsorted(mass, p)) + 1  # first prefix with mass >= p
    out = np.full_like(z, -np.inf)
    keep = order[:n_keep]
    out[keep] = z[keep]
    return out


def min_p_filter(z: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens whose probability is at least ``min_p`` times the largest one's."""
    if min_p <= 0:
        return z
    probs = softmax(z)
    return np.where(probs < min_p * probs.max(), -np.inf, z)


def pick_token(logits: np.ndarray, context_ids, opts: SamplingOptions, rng) -> int:
    """The next token id given the logits of the last position and the ids so far."""
    z = apply_repetition_penalty(logits, context_ids, opts.repetition_penalty)
    if opts.temperature == 0:
        return int(np.argmax(z))
    z = z / opts.temperature
    z = min_p_filter(top_p_filter(top_k_filter(z, opts.top_k), opts.top_p), opts.min_p)
    return draw(softmax(z), rng)


def draw(p: np.ndarray, rng) -> int:
    """``rng.choice(p.size, p=p)``'s token from the same draw, by its own steps (numpy's
    random/_generator.pyx: the cumulative sum divided by its last value, one ``random()``,
    the first index past it), without its checks of p: a Kahan sum and a sign test over
    the vocabulary, twice the time of the rest for a softmax's p, which is never negative
    and sums to 1. A NaN in p (from NaN logits) is still refused, as choice refuses it."""
    lib = engine.loaded()
    if (lib is not None and p.dtype == np.float64 and p.ndim == 1 and p.size
            and p.flags.c_contiguous):
        index = lib.tg_draw(p.ctypes.data, p.size, rng.random())   # the same index, 6x faster
        if index < 0:
            raise ValueError("Probabilities contain NaN")
        return int(index)
    cdf = np.cumsum(p)
    if not np.isfinite(cdf[-1]):
        raise ValueError("Probabilities contain NaN")
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


class TextStream:
    """Turns generated token ids into text pieces safe to print as they come.

    Decoding is redone over all new ids each time, so a character split across tokens
    (a multi-byte UTF-8 sequence, which decodes to U+FFFD until complete) is held back
    until it is whole. Text that could be the start of a stop string is held back too;
    once a stop string appears, the text is cut before it and ``stopped`` is set.
    """

    def __init__(self, tokenizer, stop_strings=()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.ids: list[int] = []
        self.text = ""          # the text so far (cut at a stop string)
        self.emitted = 0        # characters of ``text`` already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the newly printable text (maybe empty)."""
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        return self._advance(text, final=False)

    def finish(self) -> str:
        """Whatever is still held back, once generation has ended."""
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.ids, skip_special_tokens=True), final=True)

    def _advance(self, text: str, final: bool) -> str:
        cuts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if cuts:
            text, self.stopped = text[:min(cuts)], True
        safe = len(text)
        if not (final or self.stopped):
            safe -= max((n for s in self.stop_strings for n in range(len(s) - 1, 0, -1)
                         if text.endswith(s[:n])), default=0)
        self.text = text
        piece = text[self.emitted:max(safe, self.emitted)]
        self.emitted = max(safe, self.emitted)
        return piece

