"""Batched generation over a KV cache: R prompts of different lengths sampled together by
one prefill graph and one one-token decode graph (GRPO's completions, recipes/grpo.py).

>>> gen = BatchedGenerator(model, rows=8, prompt_len=32, cache_len=96)       # doctest: +SKIP
>>> completions = gen.generate(prompts, max_new_tokens=64, stop_ids=tok.end_of_turn_ids)

:func:`build_batched_generation` adds the two graphs to any Graph: standalone
(:class:`BatchedGenerator`, weights from the GGUF), or inside a training graph with
``shared=`` its decoder, so the sampler reads the very weight and adapter tensors the
optimizer updates (no copy). Per layer the cache is a K and a V ``state``
[R, n_head_kv, L, head_dim] (kvcache.py has the one-row version); the layout is:

- **Prefill**: the prompts right-padded to ``prompt_len`` = P tokens, the full-window
  forward; each layer writes its keys and values into cache rows [0, P). A row's padding
  comes after its prompt, so causal attention keeps it out of the prompt's states; the
  logits are taken at each row's last prompt token (an uploaded index per row).
- **Decode step j** writes every row's new token into cache row P + j (one ``start`` for
  the batch), at rope position n_r + j (n_r: that row's prompt length, uploaded per row).
  An additive mask per row ([R, 1, 1, L], uploaded) opens the cache rows [0, n_r) and
  [P, P + j] and closes the padding between, and on sliding-window layers the rows more
  than the window behind by position. So each row sees exactly what one-row generation
  (kvcache.py) shows it, and its tokens at temperature 0 are the same.

Sampling (temperature, top-p, ...) is ``sampling.pick_token`` on each row in turn, all
from one generator: a seed gives the same completions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toygraph.adapters.files import load_lora
from toygraph.core import ops
from toygraph.core.graph import Graph, Tensor
from toygraph.core.session import Session
from toygraph.errors import DataError
from toygraph.inference.kvcache import MASKED
from toygraph.inference.sampling import SamplingOptions, pick_token
from toygraph.models.decoder import Decoder, build_decoder


@dataclass
class BatchedGraphs:
    """Handles into the prefill and decode graphs :func:`build_batched_generation` built."""
    rows: int
    prompt_len: int
    cache_len: int
    prefill: Decoder
    decode: Decoder
    last: Tensor                   # [R] i32: row r's last prompt token, r * P + n_r - 1
    start: Tensor                  # [1] i32: the cache row the decode step writes
    prefill_start: Tensor          # [1] i32: 0, where the prefill writes its P rows
    masks: dict[int, Tensor]       # window (0: none) -> [R, 1, 1, L] additive mask
    prefill_logits: Tensor         # [R, vocab]
    decode_logits: Tensor          # [R, vocab]
    writes: list[Tensor]           # the prefill's cache writes (effects)
    programs: dict = field(default_factory=dict)   # session id -> (prefill, decode) programs

    @property
    def targets(self) -> list[Tensor]:
        """Every output and effect of the two graphs (what a shared training graph leaves
        out of its own programs)."""
        return [self.prefill_logits, self.decode_logits, *self.writes]


def build_batched_generation(g: Graph, cfg, *, rows: int, prompt_len: int, cache_len: int,
                             model=None, lora=None, shared: Decoder | None = None,
                             prefix: str = "gen.") -> BatchedGraphs:
    """Add batched prefill and decode graphs to ``g`` (module docstring): over the GGUF's
    weights (``model``), or over ``shared``'s weights and LoRA pairs."""
    if not 0 < prompt_len < cache_len <= cfg.n_ctx:
        raise DataError(f"batched generation needs 0 < prompt_len {prompt_len} < cache_len "
                        f"{cache_len} <= the context length {cfg.n_ctx}")
    # Its attention is written here over one uniform cache: a model whose layers differ from
    # that (recurrent layers, shared K/V, per-layer shapes, sinks) is refused, not sampled wrong.
    unsupported = [what for what, has in (
        ("recurrent (DeltaNet) layers", any(cfg.recurrent)),
        ("K/V shared across layers", bool(cfg.kv_sources)),
        ("per-layer head shapes", bool(cfg.head_dims or cfg.kv_heads)),
        ("attention sinks", cfg.family.sinks)) if has]
    if unsupported:
        raise DataError(f"batched generation (GRPO's sampler) does not handle {cfg.arch}'s "
                        f"{', '.join(unsupported)} yet")
    R, P, L = rows, prompt_len, cache_len
    shape = (R, cfg.n_head_kv, L, cfg.head_dim)
    caches = [tuple(g.state(f"{prefix}blk.{i}.cache_{kv}", shape, kind="cache") for kv in "kv")
              for i in range(cfg.n_layer)]
    zero = g.input(prefix + "prefill.start", (1,), "i32")   # the prompt fills rows [0, P)
    start = g.input(prefix + "decode.start", (1,), "i32")
    masks = {w: g.input(f"{prefix}decode.mask{w}", (R, 1, 1, L)) for w in set(cfg.windows)}
    writes = []

    def prefill_attend(i, q, k, v, sinks):   # sinks: None (families with sinks are refused)
        writes.extend(g.effect(ops.cache_write(c, x, zero), "forward")
                      for c, x in zip(caches[i], (k, v)))
        return ops.attention(q, k, v, scale=cfg.attn_scale, causal=True, window=cfg.windows[i])

    def decode_attend(i, q, k, v, sinks):
        kc, vc = (ops.cache_write(c, x, start) for c, x in zip(caches[i], (k, v)))
        kv, group = cfg.n_head_kv, cfg.n_head // cfg.n_head_kv
        # Query head h reads K/V head h // group: the group folded into the rows of a
        # batched matmul per (row, K/V head), [R, KV, group, hd] x [R, KV, L, hd]^T.
        scores = ops.matmul(q.reshape(R, kv, group, cfg.head_dim), kc, trans_b=True)
        probs = ops.softmax(scores + masks[cfg.windows[i]], scale=cfg.attn_scale)
        return ops.matmul(probs, vc).reshape(R, cfg.n_head, 1, cfg.head_dim)

    first = build_decoder(g, cfg, batch=R, seq_len=P, model=model, lora=lora, shared=shared,
                          prefix=prefix + "prefill.", attend=prefill_attend, logits=False)
    last = g.input(prefix + "prefill.last", (R,), "i32")
    prefill_logits = ops.matmul(ops.get_rows(first.hidden, last), first.head, trans_b=True)
    if cfg.logit_softcap:   # as lm_head caps the decode step's logits
        prefill_logits = ops.softcap(prefill_logits, cfg.logit_softcap)
    step = build_decoder(g, cfg, batch=R, seq_len=1, lora=lora, shared=first,
                         prefix=prefix + "decode.", attend=decode_attend)
    return BatchedGraphs(R, P, L, first, step, last, start, zero, masks, g.output(prefill_logits),
                         g.output(step.logits), writes)


def decode_masks(gen: BatchedGraphs, lengths, j: int, windows) -> dict[int, np.ndarray]:
    """The additive masks of decode step ``j`` ([R, 1, 1, L] per window): row r sees its
    prompt's cache rows [0, n_r) and its generated rows [P, P + j], within the window."""
    P, L = gen.prompt_len, gen.cache_len
    n = np.asarray(lengths)[:, None]
    i = np.arange(L)[None]
    seen = (i < n) | ((i >= P) & (i <= P + j))
    key_pos = np.where(i < P, i, n + i - P)       # each cache row's rope position
    out = {}
    for w in windows:
        ok = seen & ((n + j - key_pos < w) if w else True)
        out[w] = np.where(ok, 0.0, MASKED).astype(np.float32).reshape(gen.rows, 1, 1, L)
    return out


def generate_rows(sess: Session, gen: BatchedGraphs, prompts: list[list[int]],
                  max_new_tokens: int, opts: SamplingOptions = SamplingOptions(), rng=None,
                  stop_ids=(), pad: int = 0, trace: list | None = None) -> list[list[int]]:
    """Sample a completion for each of the R ``prompts`` (token ids); each ends at its first
    ``stop_ids`` token (kept: the model chose to stop) or after ``max_new_tokens``. ``rng``
    (a numpy Generator, default ``opts.rng()``) draws every row's tokens in row order.
    ``trace``, a list, receives the logits [R, vocab] each step's tokens were drawn from."""
    R, P, L = gen.rows, gen.prompt_len, gen.cache_len
    if len(prompts) != R:
        raise DataError(f"batched generation: {len(prompts)} prompts for {R} rows")
    lengths = np.array([len(p) for p in prompts])
    if lengths.min() < 1 or lengths.max() > P:
        raise DataError(f"batched generation: prompts must have 1 to {P} tokens, got "
                        f"{lengths.min()} to {lengths.max()}")
    if not 0 <= max_new_tokens <= L - P:
        raise DataError(f"batched generation: max_new_tokens must be in [0, {L - P}], got "
                        f"{max_new_tokens}")
    rng = opts.rng() if rng is None else rng
    prefill, decode = _programs(sess, gen)
    tokens = np.full((R, P), pad, np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    sess.upload(gen.prefill.tokens, tokens)
    sess.upload(gen.prefill.positions, np.tile(np.arange(P, dtype=np.int32), (R, 1)))
    sess.upload(gen.prefill_start, np.zeros(1, np.int32))
    sess.upload(gen.last, (np.arange(R) * P + lengths - 1).astype(np.int32))
    sess.run_program(prefill)
    logits = sess.download(gen.prefill_logits)
    out: list[list[int]] = [[] for _ in range(R)]
    done = [False] * R
    stop = set(int(s) for s in stop_ids)
    for j in range(max_new_tokens):
        if trace is not None:
            trace.append(logits)
        for r in range(R):
            if not done[r]:
                t = pick_token(logits[r].astype(np.float64), list(prompts[r]) + out[r], opts, rng)
                out[r].append(t)
                done[r] = t in stop
        if all(done) or j == max_new_tokens - 1:
            break
        last = np.array([o[-1] for o in out], np.int32)[:, None]
        sess.upload(gen.decode.tokens, last)
        sess.upload(gen.decode.positions, (lengths + j).astype(np.int32)[:, None])
        sess.upload(gen.start, np.array([P + j], np.int32))
        for w, m in decode_masks(gen, lengths, j, gen.masks).items():
            sess.upload(gen.masks[w], m)
        sess.run_program(decode)
        logits = sess.download(gen.decode_logits)
    return out


def _programs(sess: Session, gen: BatchedGraphs):
    key = id(sess)
    if key not in gen.programs:
        gen.programs[key] = (sess.program([gen.prefill_logits, *gen.writes]),
                             sess.program([gen.decode_logits]))
    return gen.programs[key]


class BatchedGenerator:
    """The batched prefill/decode graphs of a GGUF model (plus an optional adapter) in a
    session of their own."""

    def __init__(self, model, *, rows: int, prompt_len: int, cache_len: int,
                 backend: str = "cpu", precision: str = "f32", lora=None, adapter=None):
        g = Graph()
        self.gen = build_batched_generation(g, model.config, rows=rows, prompt_len=prompt_len,
                                            cache_len=cache_len, model=model, lora=lora)
        self.sess = Session(g, backend=backend, precision=precision)
        self.sess.realize()
        load_lora(self.sess, self.gen.prefill, adapter or {})

    def generate(self, prompts, max_new_tokens: int, opts: SamplingOptions = SamplingOptions(),
                 rng=None, stop_ids=(), pad: int = 0, trace: list | None = None) -> list[list[int]]:
        return generate_rows(self.sess, self.gen, prompts, max_new_tokens, opts, rng, stop_ids,
                             pad, trace)
