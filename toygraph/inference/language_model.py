"""Evaluation and generation with a GGUF model and, optionally, a PEFT LoRA adapter.

>>> lm = LanguageModel("SmolLM2-135M-Instruct.Q4_1.gguf", adapter_dir="out/adapter")  # doctest: +SKIP
>>> lm.loss(lm.tokenizer.encode("The capital of France is Paris."))                   # doctest: +SKIP
(2.91..., 7)
>>> lm.generate("What is the capital of France?", chat=True, max_new_tokens=16)       # doctest: +SKIP
'The capital of France is Paris.'

One forward graph is realized per (batch, seq_len) shape and cached. Shapes are rounded up
(see `_SEQ_STEP`) and sequences right-padded, so evaluating examples of many lengths
or generating from prompts of many lengths reuses a handful of graphs. Causal attention
means padding after a position never changes that position's logits.

Generation uses a KV cache by default (kvcache.py): the prompt runs once through a
prefill graph, then each new token through a one-token decode graph over the cache.
``generate(..., kv_cache=False)`` reruns the whole window per token instead (the
reference the cached path is tested against).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toygraph import ops
from toygraph.adapters.base import check_base
from toygraph.adapters.files import adapter_template, load_lora
from toygraph.adapters.merge import read_adapter, refuse_merged_twice
from toygraph.core.graph import Graph, Tensor
from toygraph.core.session import Session
from toygraph.errors import DataError, ToygraphError
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.inference.kvcache import CachedDecoder
from toygraph.inference.sampling import SamplingOptions, TextStream, pick_token
from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder
from toygraph.models.model import GGUFModel

logger = logging.getLogger(__name__)

_SEQ_STEP = 16          # graph lengths are multiples of this (capped at the context)
_TOKENS_PER_BATCH = 4096  # loss(): sequences per graph so that batch * seq stays near this
_CACHE_STEP = 64        # KV cache lengths are multiples of this (capped at the context)
_CACHED_DECODERS = 2    # prefill/decode sessions kept (each holds its own weight copies)


@dataclass
class _Forward:
    sess: Session
    tokens: Tensor
    positions: Tensor
    labels: Tensor
    logits: Tensor
    loss_sum: Tensor
    count: Tensor


@dataclass
class TargetLogits:
    """One forward pass of ``LanguageModel.target_logits``: logits [count, vocab] at the
    counted positions, their labels [count], and the graph's summed cross-entropy."""
    logits: np.ndarray
    labels: np.ndarray
    loss_sum: float
    count: int


class LanguageModel:
    """A GGUF model (plus optional PEFT LoRA adapter) for loss evaluation and generation."""

    def __init__(self, model_path, adapter_dir=None, backend: str = "cpu", seq_len: int | None = None,
                 precision: str = "f32", template: str | None = None,
                 allow_merged: bool = False, other_base: bool = False):
        # a GGUFModel may be given as it is: one whose weights were replaced in memory
        # (inference/fidelity.py's requantized or merged bases)
        self.model = model_path if isinstance(model_path, GGUFModel) else GGUFModel(model_path)
        self.cfg = self.model.config
        # the header the model parsed, read once
        self.tokenizer = Tokenizer.from_gguf(self.model.reader, source=str(self.model.path))
        self.backend, self.precision = backend, precision  # precision: toygraph.precision.PRECISIONS
        self.seq_len = min(int(seq_len), self.cfg.n_ctx) if seq_len else self.cfg.n_ctx
        if self.seq_len < 2:
            raise DataError(f"seq_len must be >= 2, got {seq_len}")
        self.lora_config, self.adapter = None, {}
        if adapter_dir is not None:
            a, source = read_adapter(adapter_dir, self.cfg)   # a directory or an adapter .gguf
            refuse_merged_twice(self.model, source, allow_merged)
            check_base(adapter_dir, self.model, other_base)
            self.lora_config = LoraConfig(targets=a.targets, rank=a.rank, alpha=a.alpha,
                                          rslora=a.rslora, dora=a.dora)
            self.adapter = a.lora
        # The chat template: the one asked for, else the one the adapter was trained with,
        # else the model's own (templates.py): prompts render as training rendered them.
        trained = (adapter_template(adapter_dir) if adapter_dir is not None and Path(adapter_dir).is_dir()
                   else None)   # an adapter .gguf records no template
        if template is not None:
            self.tokenizer.use_template(template)
        elif trained is not None:
            self.tokenizer.use_template(*trained)
        self._graphs: dict[tuple[int, int], _Forward] = {}
        self._decoders: dict[tuple[int, int], CachedDecoder] = {}
        # The tokens training teaches to end a reply with (data/encoding.py) are the ones we
        # stop on.
        self.stop_ids = self.tokenizer.end_of_turn_ids
        if not self.stop_ids:
            logger.warning("%s names no end-of-sequence or end-of-turn token: generation stops "
                           "only at the token limit or a stop string", model_path)

    def not_finite(self, what: str) -> ToygraphError:
        """The one refusal of a model (with its adapter) that computes NaN or infinity, as
        eval and generate give it: ``what`` says which numbers were not finite."""
        return ToygraphError(f"{what}: the model{' with its adapter' if self.adapter else ''} "
                             "computes values that are not finite numbers")

    # --- graphs ---------------------------------------------------------------------------
    def _forward(self, batch: int, seq_len: int) -> _Forward:
        key = (batch, seq_len)
        if key not in self._graphs:
            g = Graph()
            net = build_decoder(g, self.cfg, WeightSource(self.model), batch=batch,
                                seq_len=seq_len, lora=self.lora_config)
            labels = g.input("labels", (batch * seq_len,), "i32")
            f = _Forward(sess=Session(g, backend=self.backend, precision=self.precision), tokens=net.tokens,
                         positions=net.positions, labels=labels, logits=g.output(net.logits),
                         loss_sum=g.output(ops.cross_entropy(net.logits, labels, reduction="sum")),
                         count=g.output(ops.count_valid(labels)))
            f.sess.realize()
            load_lora(f.sess, net, self.adapter)
            self._graphs[key] = f
        return self._graphs[key]

    def _graph_len(self, n: int) -> int:
        return min(-(-n // _SEQ_STEP) * _SEQ_STEP, self.seq_len)

    def _run(self, f: _Forward, tokens: np.ndarray, labels: np.ndarray) -> None:
        B, T = tokens.shape
        f.sess.upload(f.tokens, tokens)
        f.sess.upload(f.positions, np.tile(np.arange(T, dtype=np.int32), (B, 1)))
        f.sess.upload(f.labels, labels.reshape(-1))
        f.sess.run("forward")

    def _check_ids(self, ids, what: str) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise DataError(f"{what}: expected a flat list of integer token ids")
        if len(a) > self.seq_len:
            raise DataError(f"{what}: {len(a)} tokens exceed the context of {self.seq_len}")
        if a.size and (a.min() < 0 or a.max() >= self.cfg.n_vocab):
            raise DataError(f"{what}: token ids must be in [0, {self.cfg.n_vocab})")
        return a.astype(np.int32)

    # --- loss -----------------------------------------------------------------------------
    def loss(self, token_ids, target_mask=None) -> tuple[float, int]:
        """Mean next-token cross-entropy and the number of predicted tokens.

        ``token_ids`` is one sequence or a list of them. Token i is predicted from tokens
        0..i-1; with ``target_mask`` (same structure, truthy = counted) only masked tokens
        count, e.g. the response of an instruction example. The mean is token-weighted
        over all sequences.
        """
        total, count = 0.0, 0
        for chunk in self.target_logits(token_ids, target_mask):
            total += chunk.loss_sum
            count += chunk.count
        if count == 0:
            raise DataError("loss: the target mask selects no predictable token")
        return total / count, count

    def target_logits(self, token_ids, target_mask=None, tokens_per_batch: int = _TOKENS_PER_BATCH):
        """The forward passes of ``loss`` (same arguments), one ``TargetLogits`` per graph
        run of about ``tokens_per_batch`` tokens (a graph holds [tokens, vocab] logits):
        the logits at the counted positions, their labels, and the loss summed over them
        as the graph computed it. Two models given the same sequences yield chunks of the
        same positions, in the same order (inference/fidelity.py compares them)."""
        rows = self._labelled_rows(token_ids, target_mask)
        T = self._graph_len(max(len(ids) for ids, _ in rows))
        B = min(len(rows), max(1, tokens_per_batch // T))
        for start in range(0, len(rows), B):
            # The last chunk is padded with fully ignored rows so one graph serves all.
            tokens = np.zeros((B, T), np.int32)
            labels = np.full((B, T), -1, np.int32)
            for r, (ids, lab) in enumerate(rows[start:start + B]):
                tokens[r, :len(ids)] = ids
                labels[r, :len(lab)] = lab
            f = self._forward(B, T)
            self._run(f, tokens, labels)
            counted = labels.reshape(-1) >= 0
            yield TargetLogits(logits=f.sess.download(f.logits)[counted],
                               labels=labels.reshape(-1)[counted],
                               loss_sum=float(f.sess.download(f.loss_sum)),
                               count=int(f.sess.download(f.count)))

    def _labelled_rows(self, token_ids, target_mask) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, labels) per sequence, labels -1 where not counted; checked."""
        if len(token_ids) == 0:
            raise DataError("loss: no tokens given")
        single = np.isscalar(token_ids[0])  # one flat sequence rather than a list of them
        seqs = [token_ids] if single else list(token_ids)
        masks = None if target_mask is None else [target_mask] if single else list(target_mask)
        if masks is not None and len(masks) != len(seqs):
            raise DataError(f"loss: {len(masks)} masks for {len(seqs)} sequences")
        rows = []
        for i, s in enumerate(seqs):
            ids = self._check_ids(s, f"sequence {i}")
            if len(ids) < 2:
                raise DataError(f"sequence {i}: needs at least 2 tokens to predict one, got {len(ids)}")
            lab = ids[1:].copy()
            if masks is not None:
                m = np.asarray(masks[i], bool)
                if m.shape != ids.shape:
                    raise DataError(f"sequence {i}: mask has {m.size} entries for {len(ids)} tokens")
                lab[~m[1:]] = -1
            rows.append((ids, lab))
        return rows

    # --- generation -----------------------------------------------------------------------
    def encode_prompt(self, prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt, rendered with the chat template in use when ``chat``
        (``prompt`` may then be a list of {"role", "content"} messages)."""
        tok = self.tokenizer
        if not chat:
            return tok.encode(prompt)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        # Templates that print bos_token themselves must not get a second one.
        double = tok.bos_token is not None and text.startswith(tok.bos_token)
        return tok.encode(text, add_bos=False if double else None)

    def generate(self, prompt, *, chat: bool = False, max_new_tokens: int = 64,
                 stop=(), on_text=None, kv_cache: bool = True, **sampling) -> str:
        """Continue ``prompt`` (text; token ids; with ``chat``, text or a list of messages
        rendered with the chat template): greedy by default, else as
        ``sampling`` says (SamplingOptions fields: temperature, top_k, top_p, min_p,
        repetition_penalty, seed).

        Stops at an end-of-generation token, after ``max_new_tokens``, at the context
        length, or when the text contains one of the ``stop`` strings (cut off before
        it). ``on_text(piece)`` receives the text as it is produced. ``kv_cache=False``
        reruns the whole window per token instead of decoding over a KV cache (same
        tokens, much slower). Returns the new text.
        """
        opts = SamplingOptions(**sampling)
        if max_new_tokens < 0:
            raise DataError("generate: max_new_tokens must be >= 0")
        ids = self.encode_prompt(prompt, chat) if chat or isinstance(prompt, str) else list(prompt)
        if not ids:
            raise DataError("generate: the prompt encodes to no tokens")
        if len(ids) >= self.seq_len:
            raise DataError(f"generate: the prompt has {len(ids)} tokens, leaving no room in "
                            f"the context of {self.seq_len}")
        self._check_ids(ids, "generate: the prompt")
        end = min(len(ids) + max_new_tokens, self.seq_len)
        context = [int(i) for i in ids]
        t0 = time.perf_counter()
        logits = self.next_logits(context, end, kv_cache=kv_cache)
        rng, stream = opts.rng(), TextStream(self.tokenizer, stop)
        emit = on_text or (lambda piece: None)
        while len(context) < end and not stream.stopped:
            row = next(logits)
            if not np.isfinite(row).all():   # NaN scores pick a token no one chose
                raise self.not_finite(f"the next-token scores after {len(context)} tokens "
                                      f"include {'nan' if np.isnan(row).any() else 'inf'}")
            nxt = pick_token(row.astype(np.float64), context, opts, rng)
            if nxt in self.stop_ids:
                break
            context.append(nxt)
            emit(stream.push(nxt))
        emit(stream.finish())
        if stream.stopped:
            why = "stop"             # a --stop text
        elif len(context) < end:
            why = "end"              # the model's end-of-turn token
        else:
            why = "max_new_tokens" if end == len(ids) + max_new_tokens else "context"
        #: what the last call did: prompt and new tokens, the seconds it took, and why it
        #: stopped (end, stop, max_new_tokens or context)
        self.last_generation = {"prompt_tokens": len(ids), "new_tokens": len(context) - len(ids),
                                "seconds": time.perf_counter() - t0, "stopped": why}
        return stream.text

    def next_logits(self, context: list[int], end: int, kv_cache: bool = True):
        """An iterator over next-token logits [vocab]: each ``next()`` gives those after
        ``context`` as it is then (the caller appends one token between calls), for
        sequences of up to ``end`` tokens. With ``kv_cache`` the prompt is prefilled once
        and each new token decoded over the cache; without, the whole window reruns."""
        if not 0 < len(context) <= end <= self.seq_len:
            raise DataError(f"next_logits: need 0 < {len(context)} context tokens <= end "
                            f"{end} <= the context length {self.seq_len}")
        rows = self._cached_rows(context, end) if kv_cache else self._window_rows(context, end)
        for row in rows:
            yield row
            if len(context) > end:
                raise DataError(f"next_logits: the context grew past end={end}")

    def _cached_rows(self, context: list[int], end: int):
        gen = self._cached_decoder(len(context), end)
        yield gen.prefill(context)
        while True:
            yield gen.decode(context[-1], len(context) - 1)

    def _window_rows(self, context: list[int], end: int):
        f = self._forward(1, self._graph_len(end))
        tokens = np.zeros(f.tokens.shape, np.int32)
        no_labels = np.full(f.tokens.shape, -1, np.int32)
        while True:
            n = len(context)
            tokens[0, :n] = context
            self._run(f, tokens, no_labels)
            yield f.sess.download(f.logits)[n - 1]

    def _cached_decoder(self, prompt_len: int, end: int) -> CachedDecoder:
        """The prefill/decode session for a prompt of ``prompt_len`` tokens growing to at
        most ``end``; shapes are rounded up so nearby lengths share one."""
        P = self._graph_len(prompt_len)
        L = min(-(-max(end, P) // _CACHE_STEP) * _CACHE_STEP, self.seq_len)
        key = (P, L)
        if key not in self._decoders:
            if len(self._decoders) >= _CACHED_DECODERS:  # free the oldest session's memory
                del self._decoders[next(iter(self._decoders))]
            self._decoders[key] = CachedDecoder(self.model, prompt_len=P, cache_len=L,
                                                backend=self.backend, precision=self.precision,
                                                lora=self.lora_config, adapter=self.adapter)
        return self._decoders[key]
