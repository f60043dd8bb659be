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

Every family: per layer the cache has that layer's K/V heads and head dim (Gemma 4; its
KV-sharing layers get their source layer's keys and values and cache them again), gpt-oss's
sinks are one more never-written cache row as in kvcache.py, and Qwen3.5's DeltaNet layers
keep kvcache.py's conv rows and delta-rule state with a row axis (``_BatchedRecurrent``).

Sampling (temperature, top-p, ...) is ``sampling.pick_token`` on each row in turn, all
from one generator: a seed gives the same completions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toygraph.adapters.files import load_lora
from toygraph import ops
from toygraph.core.graph import Graph, Tensor
from toygraph.core.session import Session
from toygraph.errors import DataError
from toygraph.inference.kvcache import MASKED, CacheDecode, CachePrefill, kv_caches, windows
from toygraph.inference.sampling import SamplingOptions, pick_token
from toygraph.models.decoder import BuildOptions, Decoder, WeightSource, build_decoder
from toygraph.models.parts import DeltaNet


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
    masks: dict[int, Tensor]       # window (0: none) -> [R, 1, 1, L (+ the sink row)] mask
    prefill_logits: Tensor         # [R, vocab]
    decode_logits: Tensor          # [R, vocab]
    writes: list[Tensor]           # the prefill's cache and state writes (effects)
    decode_writes: list[Tensor]    # the decode step's recurrent state writes (effects)
    sink_row: int = 0              # 1 where the family has attention sinks (kvcache.py)
    recurrent: "_BatchedRecurrent | None" = None
    programs: dict = field(default_factory=dict)   # session id -> (prefill, decode) programs

    @property
    def targets(self) -> list[Tensor]:
        """Every output and effect of the two graphs (what a shared training graph leaves
        out of its own programs)."""
        return [self.prefill_logits, self.decode_logits, *self.writes, *self.decode_writes]


def build_batched_generation(g: Graph, cfg, *, rows: int, prompt_len: int, cache_len: int,
                             model=None, lora=None, shared: Decoder | None = None,
                             prefix: str = "gen.") -> BatchedGraphs:
    """Add batched prefill and decode graphs to ``g`` (module docstring): over the GGUF's
    weights (``model``), or over ``shared``'s weights and LoRA pairs."""
    if not 0 < prompt_len < cache_len <= cfg.n_ctx:
        raise DataError(f"batched generation needs 0 < prompt_len {prompt_len} < cache_len "
                        f"{cache_len} <= the context length {cfg.n_ctx}")
    R, P, L = rows, prompt_len, cache_len
    caches, sink_row = kv_caches(g, cfg, R, L, prefix)
    zero = g.input(prefix + "prefill.start", (1,), "i32")   # the prompt fills rows [0, P)
    start = g.input(prefix + "decode.start", (1,), "i32")
    masks = {w: g.input(f"{prefix}decode.mask{w}", (R, 1, 1, L + sink_row)) for w in windows(cfg)}
    sink_col = (g.const(prefix + "decode.sink_col", np.eye(L + 1, dtype=np.float32)[-1])
                if sink_row else None)
    rec = _BatchedRecurrent(g, cfg, R, P, L, prefix) if cfg.ssm else None
    prefill, decode = CachePrefill(g, caches, zero, rec), _Decode(g, caches, start, masks,
                                                                  sink_col, rec)
    first = build_decoder(g, cfg, WeightSource(model, shared=shared), batch=R, seq_len=P,
                          lora=lora, options=BuildOptions(logits=False, prefix=prefix + "prefill.",
                                                          sequence=prefill))
    last = g.input(prefix + "prefill.last", (R,), "i32")
    prefill_logits = ops.matmul(ops.get_rows(first.hidden, last), first.head, trans_b=True)
    if cfg.logit_softcap:   # as lm_head caps the decode step's logits
        prefill_logits = ops.softcap(prefill_logits, cfg.logit_softcap)
    step = build_decoder(g, cfg, WeightSource(shared=first), batch=R, seq_len=1, lora=lora,
                         options=BuildOptions(prefix=prefix + "decode.", sequence=decode))
    return BatchedGraphs(R, P, L, first, step, last, start, zero, masks, g.output(prefill_logits),
                         g.output(step.logits), prefill.writes, decode.writes, sink_row, rec)


class _BatchedRecurrent:
    """Qwen3.5's DeltaNet layers in batched generation: kvcache.py's two states per layer
    with a leading row axis. Row r's prompt has n_r tokens: the prefill zeroes the decay and
    write strength of its padding (``valid`` [R, P, 1]), so its state is the state after its
    own tokens; the conv rows it writes sit where the attention caches put that row's
    tokens (prompt rows [0, n_r), generated ones from P), and decode step j reads, per row,
    the conv window ending at its new token through a one-hot selection [R, width, L]."""

    def __init__(self, g, cfg, R: int, P: int, L: int, prefix: str):
        nets = {i: layer.mixer for i, layer in enumerate(cfg.layers)
                if isinstance(layer.mixer, DeltaNet)}
        ssm = next(iter(nets.values()))
        self.width, self.prompt_len, self.cache_len = ssm.conv, P, L
        self.rows = {i: g.state(f"{prefix}blk.{i}.conv_rows", (R, 1, L, d.channels),
                                kind="cache") for i, d in nets.items()}
        shape = (R, ssm.v_heads, ssm.k_dim, ssm.v_dim)
        self.states = {i: g.state(f"{prefix}blk.{i}.delta_state", shape, kind="cache")
                       for i in nets}
        self.zero_state = g.const(prefix + "delta_state.zero", np.zeros(shape, np.float32))
        self.valid = g.input(prefix + "prefill.valid", (R, P, 1))
        self.select = g.input(prefix + "decode.conv_rows", (R, ssm.conv, L))
        self.zero = g.input(prefix + "decode.zero", (1,), "i32")

    def upload_prefill(self, sess, lengths) -> None:
        valid = (np.arange(self.prompt_len)[None] < np.asarray(lengths)[:, None])
        sess.upload(self.valid, valid.astype(np.float32)[..., None])

    def upload_decode(self, sess, lengths, j: int) -> None:
        """Step j's selection: row r's taps read positions n_r + j - (width - 1) .. n_r + j,
        at cache row p (a prompt token) or P + p - n_r (a generated one)."""
        select = np.zeros(self.select.shape, np.float32)
        for r, n in enumerate(lengths):
            for tap in range(self.width):
                pos = n + j - (self.width - 1) + tap
                if pos >= 0:
                    select[r, tap, pos if pos < n else self.prompt_len + pos - n] = 1.0
        sess.upload(self.select, select)
        sess.upload(self.zero, np.zeros(1, np.int32))


class _Decode(CacheDecode):
    """kvcache.py's decode step, the conv window selected per row."""

    def conv(self, i, x, w):
        R, _, C = x.shape
        rows = ops.cache_write(self.s.rows[i], x.reshape(R, 1, 1, C), self.pos)
        window = ops.matmul(self.s.select, rows.reshape(R, self.s.cache_len, C))  # [R, width, C]
        return ops.sum(window.permute(0, 2, 1) * w, 2).reshape(R, 1, C)


def decode_masks(gen: BatchedGraphs, lengths, j: int, windows) -> dict[int, np.ndarray]:
    """The additive masks of decode step ``j`` ([R, 1, 1, L (+ 1)] per window): row r sees
    its prompt's cache rows [0, n_r) and its generated rows [P, P + j], within the window,
    and the sink's row where there is one."""
    P, L = gen.prompt_len, gen.cache_len
    n = np.asarray(lengths)[:, None]
    i = np.arange(L)[None]
    seen = (i < n) | ((i >= P) & (i <= P + j))
    key_pos = np.where(i < P, i, n + i - P)       # each cache row's rope position
    out = {}
    for w in windows:
        ok = seen & ((n + j - key_pos < w) if w else True)
        ok = np.concatenate([ok, np.ones((len(ok), gen.sink_row), bool)], axis=1)
        out[w] = np.where(ok, 0.0, MASKED).astype(np.float32).reshape(gen.rows, 1, 1, -1)
    return out


def generate_rows(sess: Session, gen: BatchedGraphs, prompts: list[list[int]],
                  max_new_tokens: int, opts: SamplingOptions = SamplingOptions(), rng=None,
                  stop_ids=(), pad: int = 0, trace: list | None = None, *,
                  call_ids=(), tool_turn=None, own: list | None = None) -> list[list[int]]:
    """Sample a completion for each of the R ``prompts`` (token ids); each ends at its first
    ``stop_ids`` token (kept: the model chose to stop) or after ``max_new_tokens``. ``rng``
    (a numpy Generator, default ``opts.rng()``) draws every row's tokens in row order.
    ``trace``, a list, receives the logits [R, vocab] each step's tokens were drawn from.

    Tool rounds (recipes/tools.py): when row r samples one of ``call_ids`` (the token that
    closes a tool call), ``tool_turn(r, completion so far)`` gives the tokens that follow
    it -- the tool's reply as the template renders a tool turn, then the next assistant
    turn's start -- and they are fed to the row one per decode step, as forced tokens, in
    the row's completion and cache like its own, after which it samples again; no stop id
    among them stops the row. A stop id may be a call id too (an environment answers
    each end of turn): it stops the row only when ``tool_turn`` feeds it nothing.
    ``own``, a list, receives per row whether each completion token was sampled (True) or
    forced (False): the loss covers the sampled ones only."""
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
    if gen.recurrent:
        gen.recurrent.upload_prefill(sess, lengths)
    sess.run_program(prefill)
    logits = sess.download(gen.prefill_logits)
    out: list[list[int]] = [[] for _ in range(R)]
    sampled: list[list[bool]] = [[] for _ in range(R)]
    forced: list[list[int]] = [[] for _ in range(R)]
    done = [False] * R
    stop, calls = set(int(s) for s in stop_ids), set(int(c) for c in call_ids)
    for j in range(max_new_tokens):
        if trace is not None:
            trace.append(logits)
        for r in range(R):
            if done[r]:
                continue
            if forced[r]:   # a tool turn being fed: its logits are not drawn from
                out[r].append(forced[r].pop(0))
                sampled[r].append(False)
                continue
            t = pick_token(logits[r].astype(np.float64), list(prompts[r]) + out[r], opts, rng)
            out[r].append(t)
            sampled[r].append(True)
            if t in calls and tool_turn is not None:
                forced[r] = [int(x) for x in tool_turn(r, list(out[r]))]
            done[r] = t in stop and not forced[r]   # an environment's next turn goes on
        if all(done) or j == max_new_tokens - 1:
            break
        last = np.array([o[-1] for o in out], np.int32)[:, None]
        sess.upload(gen.decode.tokens, last)
        sess.upload(gen.decode.positions, (lengths + j).astype(np.int32)[:, None])
        sess.upload(gen.start, np.array([P + j], np.int32))
        for w, m in decode_masks(gen, lengths, j, gen.masks).items():
            sess.upload(gen.masks[w], m)
        if gen.recurrent:
            gen.recurrent.upload_decode(sess, lengths, j)
        sess.run_program(decode)
        logits = sess.download(gen.decode_logits)
    if own is not None:
        own.extend(sampled)
    return out


def _programs(sess: Session, gen: BatchedGraphs):
    key = id(sess)
    if key not in gen.programs:
        gen.programs[key] = (sess.program([gen.prefill_logits, *gen.writes]),
                             sess.program([gen.decode_logits, *gen.decode_writes]))
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
                 rng=None, stop_ids=(), pad: int = 0, trace: list | None = None,
                 **tool_rounds) -> list[list[int]]:
        """generate_rows on these graphs (``tool_rounds``: its call_ids, tool_turn, own)."""
        return generate_rows(self.sess, self.gen, prompts, max_new_tokens, opts, rng, stop_ids,
                             pad, trace, **tool_rounds)
