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

**One prefill per distinct prompt.** GRPO samples a group of G completions of each prompt,
so its R rows hold R / G prompts. A prefill may run over U <= R *prompt rows*
(``prompt_rows``): every cache or state it writes is first spread to the R rows, cache row
r taking prompt row map[r] (an uploaded [R] i32 map, one get_rows along the row axis), and
row r's first logits are its prompt row's, picked on the host. The forward over a prompt
thus runs once for its group; the decode steps are per row as above. ``prompt_rows`` may
name several sizes (GRPO: U for its groups, R for evaluation, where every row is its own
prompt): each is a prefill of its own over the same weights and caches, and
:func:`generate_rows` runs the smallest that holds the request's distinct prompts. With
U == R (the default) there is no map and no gather: the prefill is the one above.

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
class PromptPass:
    """One prefill graph over U prompt rows (module docstring)."""
    rows: int                      # U
    net: Decoder
    last: Tensor                   # [U] i32: prompt row u's last token, u * P + n_u - 1
    map: Tensor | None             # [R] i32: each cache row's prompt row; None when U == R
    valid: Tensor | None           # [U, P, 1]: 1 on the prompts' tokens (DeltaNet layers)
    logits: Tensor                 # [U, vocab]
    writes: list[Tensor]           # its cache and state writes (effects)

    @property
    def targets(self) -> list[Tensor]:
        return [self.logits, *self.writes]


@dataclass
class BatchedGraphs:
    """Handles into the prefill and decode graphs :func:`build_batched_generation` built."""
    rows: int
    prompt_len: int
    cache_len: int
    passes: list[PromptPass]       # the prefills, by their prompt rows U, smallest first
    decode: Decoder
    start: Tensor                  # [1] i32: the cache row the decode step writes
    prefill_start: Tensor          # [1] i32: 0, where the prefill writes its P rows
    masks: dict[int, Tensor]       # window (0: none) -> [R, 1, 1, L (+ the sink row)] mask
    decode_logits: Tensor          # [R, vocab]
    decode_writes: list[Tensor]    # the decode step's recurrent state writes (effects)
    sink_row: int = 0              # 1 where the family has attention sinks (kvcache.py)
    recurrent: "_BatchedRecurrent | None" = None
    programs: dict = field(default_factory=dict)   # (session id, U or 0) -> program

    @property
    def prefill(self) -> Decoder:
        """The first prefill's decoder: it holds the weights and LoRA pairs all share."""
        return self.passes[0].net

    @property
    def targets(self) -> list[Tensor]:
        """Every output and effect of the graphs (what a shared training graph leaves
        out of its own programs)."""
        return [t for p in self.passes for t in p.targets] + [self.decode_logits,
                                                               *self.decode_writes]


def build_batched_generation(g: Graph, cfg, *, rows: int, prompt_len: int, cache_len: int,
                             prompt_rows=None, model=None, lora=None,
                             shared: Decoder | None = None, prefix: str = "gen.") -> BatchedGraphs:
    """Add batched prefill and decode graphs to ``g`` (module docstring): over the GGUF's
    weights (``model``), or over ``shared``'s weights and LoRA pairs. ``prompt_rows``: the
    prefills' numbers of prompt rows U (an int or several; default ``rows``)."""
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
    passes, source = [], WeightSource(model, shared=shared)
    for U in _prompt_rows(prompt_rows, R):
        name = prefix + ("prefill." if U == R else f"prefill{U}.")
        seq = _Prefill(g, caches, zero, rec, U, R, name)
        passes.append(_prompt_pass(g, cfg, P, seq, source, lora, name))
        source = WeightSource(shared=passes[0].net)   # one set of weights for every graph
    decode = _Decode(g, caches, start, masks, sink_col, rec)
    step = build_decoder(g, cfg, source, batch=R, seq_len=1, lora=lora,
                         options=BuildOptions(prefix=prefix + "decode.", sequence=decode))
    return BatchedGraphs(R, P, L, passes, step, start, zero, masks, g.output(step.logits),
                         decode.writes, sink_row, rec)


def _prompt_rows(prompt_rows, R: int) -> list[int]:
    """The prefills' sizes U, smallest first: each 1 <= U <= R."""
    sizes = sorted({R} if prompt_rows is None else
                   {int(u) for u in np.atleast_1d(prompt_rows)})
    if not sizes or not 1 <= sizes[0] <= sizes[-1] <= R:
        raise DataError(f"batched generation: prompt_rows must be in [1, {R}] (the rows), "
                        f"got {prompt_rows}")
    return sizes


def _prompt_pass(g, cfg, P: int, seq: "_Prefill", source, lora, name: str) -> PromptPass:
    """The decoder over ``seq``'s U prompt rows of P tokens, and its logits at each one's
    last token."""
    U = seq.prompt_rows
    net = build_decoder(g, cfg, source, batch=U, seq_len=P, lora=lora,
                        options=BuildOptions(logits=False, prefix=name, sequence=seq))
    last = g.input(name + "last", (U,), "i32")
    logits = ops.matmul(ops.get_rows(net.hidden, last), net.head, trans_b=True)
    if cfg.logit_softcap:   # as lm_head caps the decode step's logits
        logits = ops.softcap(logits, cfg.logit_softcap)
    return PromptPass(U, net, last, seq.map, seq.s.valid if seq.s else None, g.output(logits),
                      seq.writes)


class _BatchedRecurrent:
    """Qwen3.5's DeltaNet layers in batched generation: kvcache.py's two states per layer
    with a leading row axis. Row r's prompt has n_r tokens: the prefill zeroes the decay and
    write strength of its padding (``valid``, per prefill: :class:`_PromptStates`), so its
    state is the state after its own tokens; the conv rows it writes sit where the
    attention caches put that row's tokens (prompt rows [0, n_r), generated ones from P),
    and decode step j reads, per row, the conv window ending at its new token through a
    one-hot selection [R, width, L]."""

    def __init__(self, g, cfg, R: int, P: int, L: int, prefix: str):
        nets = {i: layer.mixer for i, layer in enumerate(cfg.layers)
                if isinstance(layer.mixer, DeltaNet)}
        ssm = next(iter(nets.values()))
        self.width, self.prompt_len, self.cache_len = ssm.conv, P, L
        self.rows = {i: g.state(f"{prefix}blk.{i}.conv_rows", (R, 1, L, d.channels),
                                kind="cache") for i, d in nets.items()}
        self.state_shape = (R, ssm.v_heads, ssm.k_dim, ssm.v_dim)
        self.states = {i: g.state(f"{prefix}blk.{i}.delta_state", self.state_shape,
                                  kind="cache") for i in nets}
        self.select = g.input(prefix + "decode.conv_rows", (R, ssm.conv, L))
        self.zero = g.input(prefix + "decode.zero", (1,), "i32")

    def for_prompts(self, g, U: int, name: str) -> "_PromptStates":
        """What a prefill over U prompt rows reads: the R-row states it writes, and its own
        rows' padding mask and zero start state."""
        valid = g.input(name + "valid", (U, self.prompt_len, 1))
        zero = g.const(name + "delta_state.zero",
                       np.zeros((U, *self.state_shape[1:]), np.float32))
        return _PromptStates(self.rows, self.states, valid, zero)

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


@dataclass
class _PromptStates:
    """kvcache.CachePrefill's ``states`` for a prefill over U prompt rows."""
    rows: dict             # layer -> conv rows [R, 1, L, channels]
    states: dict           # layer -> delta-rule state [R, v_heads, k_dim, v_dim]
    valid: Tensor          # [U, P, 1]
    zero_state: Tensor     # [U, v_heads, k_dim, v_dim] zeros: where the prompt starts


class _Prefill(CachePrefill):
    """kvcache.py's prefill over U prompt rows. With U < R, each cache or state it writes
    is spread to the R rows first: row r gets prompt row map[r], so a group's rows share
    the one forward of their prompt."""

    def __init__(self, g, caches: dict, start, rec, U: int, R: int, name: str):
        super().__init__(g, caches, start, rec.for_prompts(g, U, name) if rec else None)
        self.prompt_rows = U
        self.map = g.input(name + "map", (R,), "i32") if U < R else None

    def _write(self, cache, x, at):
        super()._write(cache, self._spread(x), at)

    def _spread(self, x):
        """x [U, ...] -> [R, ...], row r being x's row map[r]: get_rows of x's rows
        flattened (every write has the rows first: keys and values heads-first, conv rows,
        delta-rule states)."""
        if self.map is None:
            return x
        U, R = x.shape[0], self.map.shape[0]
        return ops.get_rows(x.reshape(U, x.size // U), self.map).reshape(R, *x.shape[1:])


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
    Equal prompts share one prompt row of the prefill (module docstring); more distinct
    prompts than the largest prefill's U are a DataError.

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
    logits = _prefill(sess, gen, prompts, pad)
    decode = _program(sess, gen, 0, [gen.decode_logits, *gen.decode_writes])
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


def distinct_prompts(prompts) -> tuple[list[list[int]], np.ndarray]:
    """The distinct prompts, first seen first, and each row's index among them [R] i32."""
    index: dict[tuple, int] = {}
    row_of = [index.setdefault(tuple(int(t) for t in p), len(index)) for p in prompts]
    return [list(p) for p in index], np.array(row_of, np.int32)


def _pick_pass(gen: BatchedGraphs, prompts) -> tuple[PromptPass, list, np.ndarray]:
    """(the smallest prefill holding the distinct prompts, its U prompt rows, each row's
    prompt row [R]). Prompt rows past the distinct prompts repeat the first: computed, but
    no cache row is spread from them."""
    distinct, row_of = distinct_prompts(prompts)
    for p in gen.passes:
        if p.map is None:   # U == R: every row is its own prompt row, as today
            return p, list(prompts), np.arange(gen.rows, dtype=np.int32)
        if len(distinct) <= p.rows:
            return p, distinct + [distinct[0]] * (p.rows - len(distinct)), row_of
    raise DataError(f"batched generation: {len(distinct)} distinct prompts, but the prefill "
                    f"has {gen.passes[-1].rows} prompt rows (build it with prompt_rows up to "
                    f"{gen.rows})")


def _prefill(sess: Session, gen: BatchedGraphs, prompts, pad: int) -> np.ndarray:
    """Run the prompts through the prefill (:func:`_pick_pass`), filling every row's cache;
    returns each row's logits [R, vocab], its prompt row's."""
    p, rows, row_of = _pick_pass(gen, prompts)
    U, P = p.rows, gen.prompt_len
    lengths = np.array([len(x) for x in rows])
    tokens = np.full((U, P), pad, np.int32)
    for u, ids in enumerate(rows):
        tokens[u, :len(ids)] = ids
    sess.upload(p.net.tokens, tokens)
    sess.upload(p.net.positions, np.tile(np.arange(P, dtype=np.int32), (U, 1)))
    sess.upload(gen.prefill_start, np.zeros(1, np.int32))
    sess.upload(p.last, (np.arange(U) * P + lengths - 1).astype(np.int32))
    if p.map is not None:
        sess.upload(p.map, row_of)
    if p.valid is not None:   # the delta rule's: 1 on each prompt row's own tokens
        valid = np.arange(P)[None] < lengths[:, None]
        sess.upload(p.valid, valid.astype(np.float32)[..., None])
    sess.run_program(_program(sess, gen, U, p.targets))
    return sess.download(p.logits)[row_of]


def _program(sess: Session, gen: BatchedGraphs, key: int, targets):
    """The session's program of ``targets`` (key: a prefill's U, or 0: the decode step),
    made once."""
    k = (id(sess), key)
    if k not in gen.programs:
        gen.programs[k] = sess.program(targets)
    return gen.programs[k]


class BatchedGenerator:
    """The batched prefill/decode graphs of a GGUF model (plus an optional adapter) in a
    session of their own."""

    def __init__(self, model, *, rows: int, prompt_len: int, cache_len: int,
                 prompt_rows=None, backend: str = "cpu", precision: str = "f32", lora=None,
                 adapter=None):
        g = Graph()
        self.gen = build_batched_generation(g, model.config, rows=rows, prompt_len=prompt_len,
                                            cache_len=cache_len, prompt_rows=prompt_rows,
                                            model=model, lora=lora)
        self.sess = Session(g, backend=backend, precision=precision)
        self.sess.realize()
        load_lora(self.sess, self.gen.prefill, adapter or {})

    def generate(self, prompts, max_new_tokens: int, opts: SamplingOptions = SamplingOptions(),
                 rng=None, stop_ids=(), pad: int = 0, trace: list | None = None,
                 **tool_rounds) -> list[list[int]]:
        """generate_rows on these graphs (``tool_rounds``: its call_ids, tool_turn, own)."""
        return generate_rows(self.sess, self.gen, prompts, max_new_tokens, opts, rng, stop_ids,
                             pad, trace, **tool_rounds)
