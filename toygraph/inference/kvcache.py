"""Generation with a KV cache: a prefill graph and a one-token decode graph in one session.

>>> gen = CachedDecoder(model, prompt_len=16, cache_len=320)     # doctest: +SKIP
>>> row = gen.prefill(ids)               # logits after the prompt (len(ids) <= 16)
>>> row = gen.decode(token, len(ids))    # logits after `token`, placed at that position

Both graphs live in one Graph and one Session, so they share the weights (bound once) and
the cache: per attention layer a K and a V ``state`` tensor [1, its KV heads, cache_len,
its head size] (``kv_caches``: the sizes of the layer's Attention part) in the session's
buffer plan (core/buffer_plan.py), written in place by the ``cache_write`` op
(ops/cache/). Each is realized once per (prompt_len, cache_len) and replayed as a
session program.

- **Prefill** is the decoder over the prompt right-padded to ``prompt_len`` tokens,
  exactly the full-window forward (fused causal attention), plus per layer the write of
  its keys and values (after q/k norms and rope) into cache rows [0, prompt_len). The
  padding's rows land in the cache too; decode masks them until it overwrites them.
- **Decode** is the decoder over one token at an uploaded position p. Per layer,
  cache_write puts the token's key and value in row p and hands on the cache; attention
  is ``softmax(scale * (q K^T + mask)) V`` over all ``cache_len`` rows with existing ops,
  the additive mask 0 on the rows the token may see and MASKED elsewhere (causal, and the
  sliding window on the layers that have one: one mask per distinct window).
- **Sinks** (gpt-oss): prefill passes them to the fused attention; decode gives each cache
  one more row, never written (zero key, zero value), whose score q.0 = 0 gets sinks[h] /
  scale added per head: that row is exactly the sink's zero-value logit in the softmax.

Per decode step the host uploads the token id, its position (for rope and for the cache
row) and the masks, runs the decode program and downloads the one row of logits.

Qwen3.5's Gated DeltaNet layers carry no keys and values but two states (``_Recurrent``):
the rows entering the causal conv (a cache like K's, [1, 1, cache_len, channels]; decode
reads the last conv-width rows through a one-hot [width, cache_len] selection uploaded per
step) and the delta rule's state [1, v_heads, k_dim, v_dim]. Prefill runs the delta rule
with the padding's decay and write strength zeroed, so its final state is the state after
the prompt's own tokens; decode continues from it and writes it back.
"""
from __future__ import annotations

import numpy as np

from toygraph.adapters.files import load_lora
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.ops.flash_attention import TOKEN_MAJOR
from toygraph.core.session import Session
from toygraph.models.decoder import BuildOptions, WeightSource, build_decoder
from toygraph.models.parts import Attention, DeltaNet
from toygraph.models.sequence import SequenceOps


def heads_first(x):
    """Token-major keys or values [B, T, KV, hd] as the caches hold them, [B, KV, T, hd]."""
    return x.permute(0, 2, 1, 3)


#: The additive mask of rows a query may not see. Finite, because uploads refuse NaN and
#: inf; softmax subtracts the row maximum first, so these rows' weights are exactly 0.
MASKED = -1e30


def attention_layers(cfg) -> dict[int, Attention]:
    """Layer index -> its attention part, for the layers that have one."""
    return {i: layer.attention for i, layer in enumerate(cfg.layers) if layer.attention}


def kv_caches(g, cfg, rows: int, cache_len: int, prefix: str = "") -> tuple[dict, int]:
    """Per attention layer a K and a V cache ``state`` [rows, its KV heads, cache_len (+ the
    sink row), its head size], and the sink row (1 where some layer has sinks: one extra,
    never-written row). Gemma 4's KV-sharing layers cache their source's keys and values
    again."""
    attn = attention_layers(cfg)
    sink_row = int(any(a.sinks for a in attn.values()))
    return {i: tuple(g.state(f"{prefix}blk.{i}.cache_{kv}",
                             (rows, a.kv_heads, cache_len + sink_row, a.head_dim), kind="cache")
                     for kv in "kv") for i, a in attn.items()}, sink_row


def windows(cfg) -> list[int]:
    """The distinct attention windows of the layers (0: full), one decode mask each."""
    return sorted({a.window for a in attention_layers(cfg).values()})


class CachedDecoder:
    """The prefill and decode programs of one model for one (prompt_len, cache_len)."""

    def __init__(self, model, *, prompt_len: int, cache_len: int, backend: str = "cpu",
                 precision: str = "f32", lora=None, adapter=None):
        cfg = model.config
        self.cfg, self.cache_len = cfg, cache_len
        g = Graph()
        self.caches, self.sink_row = kv_caches(g, cfg, 1, cache_len)
        self.start = g.input("prefill.start", (1,), "i32")  # 0: the prompt fills rows [0, P)
        self.pos = g.input("decode.pos", (1,), "i32")       # the decode position again, [1]
        rec = _Recurrent(g, cfg, prompt_len, cache_len) if cfg.ssm else None
        prefill = CachePrefill(g, self.caches, self.start, rec)
        self.first = build_decoder(g, cfg, WeightSource(model), batch=1, seq_len=prompt_len,
                                   lora=lora, options=BuildOptions(sequence=prefill))
        self.masks = {w: g.input(f"decode.mask{w}", (cache_len + self.sink_row,))
                      for w in windows(cfg)}
        # 1 on the sink's row: times sinks[h] / scale, added to the scores
        sink_col = (g.const("decode.sink_col", np.eye(cache_len + 1, dtype=np.float32)[-1])
                    if self.sink_row else None)
        decode = CacheDecode(g, self.caches, self.pos, self.masks, sink_col, rec)
        self.step = build_decoder(g, cfg, WeightSource(shared=self.first), batch=1, seq_len=1,
                                  lora=lora, options=BuildOptions(prefix="decode.",
                                                                  sequence=decode))
        for net in (self.first, self.step):
            g.output(net.logits)
        self.recurrent = rec
        self.sess = Session(g, backend=backend, precision=precision)
        self.sess.realize()
        load_lora(self.sess, self.first, adapter or {})
        self.prefill_program = self.sess.program([self.first.logits] + prefill.writes)
        self.decode_program = self.sess.program([self.step.logits] + decode.writes)

    def prefill(self, ids) -> np.ndarray:
        """Run the prompt ``ids`` (at most prompt_len tokens) through the model, filling
        the cache; returns the logits [vocab] of the next token."""
        n, P = len(ids), self.first.tokens.shape[1]
        tokens = np.zeros((1, P), np.int32)
        tokens[0, :n] = ids
        sess = self.sess
        sess.upload(self.first.tokens, tokens)
        sess.upload(self.first.positions, np.arange(P, dtype=np.int32)[None])
        sess.upload(self.start, np.zeros(1, np.int32))
        if self.recurrent:
            self.recurrent.upload_prefill(sess, n)
        sess.run_program(self.prefill_program)
        return sess.download(self.first.logits)[n - 1]

    def decode(self, token: int, pos: int) -> np.ndarray:
        """Run ``token`` at position ``pos`` (every earlier position already in the cache);
        returns the logits [vocab] of the token after it."""
        sess = self.sess
        sess.upload(self.step.tokens, np.array([[token]], np.int32))
        sess.upload(self.step.positions, np.array([[pos]], np.int32))
        sess.upload(self.pos, np.array([pos], np.int32))
        rows = np.arange(self.cache_len)
        for window, mask in self.masks.items():
            seen = (rows <= pos) & ((pos - rows < window) if window else True)
            seen = np.concatenate([seen, [True] * self.sink_row])   # the sink is always seen
            sess.upload(mask, np.where(seen, 0.0, MASKED).astype(np.float32))
        if self.recurrent:
            self.recurrent.upload_decode(sess, pos)
        sess.run_program(self.decode_program)
        return sess.download(self.step.logits)[0]


class _Recurrent:
    """The DeltaNet layers' states (see above), sized by their parts."""

    def __init__(self, g, cfg, prompt_len: int, cache_len: int):
        nets = {i: layer.mixer for i, layer in enumerate(cfg.layers)
                if isinstance(layer.mixer, DeltaNet)}
        ssm = next(iter(nets.values()))
        self.width, self.cache_len = ssm.conv, cache_len
        self.rows = {i: g.state(f"blk.{i}.conv_rows", (1, 1, cache_len, d.channels), kind="cache")
                     for i, d in nets.items()}
        shape = (1, ssm.v_heads, ssm.k_dim, ssm.v_dim)
        self.states = {i: g.state(f"blk.{i}.delta_state", shape, kind="cache") for i in nets}
        self.zero_state = g.const("delta_state.zero", np.zeros(shape, np.float32))
        self.valid = g.input("prefill.valid", (1, prompt_len, 1))      # 1 on the prompt's tokens
        self.select = g.input("decode.conv_rows", (ssm.conv, cache_len))  # one-hot window rows
        self.zero = g.input("decode.zero", (1,), "i32")

    def upload_prefill(self, sess, n: int) -> None:
        valid = np.zeros(self.valid.shape, np.float32)
        valid[0, :n] = 1.0
        sess.upload(self.valid, valid)

    def upload_decode(self, sess, pos: int) -> None:
        select = np.zeros(self.select.shape, np.float32)
        for j in range(self.width):   # tap j reads row pos - (width - 1) + j
            row = pos - (self.width - 1) + j
            if row >= 0:
                select[j, row] = 1.0
        sess.upload(self.select, select)
        sess.upload(self.zero, np.zeros(1, np.int32))


class CachePrefill(SequenceOps):
    """The prompt's pass: the full-window ops, each attention layer's keys and values
    written into cache rows [start, start + T), each DeltaNet layer's conv input rows and
    final state (``states``) written too; ``writes`` collects those effects."""

    def __init__(self, g, caches: dict, start, states=None):
        self.g, self.caches, self.start, self.s, self.writes = g, caches, start, states, []

    def _write(self, cache, x, at):
        self.writes.append(self.g.effect(ops.cache_write(cache, x, at), "forward"))

    def attention(self, i, part, q, k, v, sinks, segments):   # token-major q, k, v
        for cache, x in zip(self.caches[i], (k, v)):
            self._write(cache, heads_first(x), self.start)
        return ops.attention(q, k, v, scale=part.scale, causal=True, window=part.window,
                             sinks=sinks, layout=TOKEN_MAJOR, save_lse=False)

    def conv(self, i, x, w):
        B, T, C = x.shape   # B: 1 here, the rows of batched generation (batched.py)
        self._write(self.s.rows[i], x.reshape(B, 1, T, C), self.start)
        return ops.causal_conv1d(x, w)

    def delta(self, i, q, k, v, g, beta):
        o, state = ops.delta_rule(q, k, v, g * self.s.valid, beta * self.s.valid,
                                  state=self.s.zero_state)
        self._write(self.s.states[i], state, self.start)
        return o


class CacheDecode(SequenceOps):
    """One new token per row at cache row ``pos``: attention over every cache row through
    the additive ``masks`` (one per window), the sinks as the extra row ``sink_col`` marks;
    the DeltaNet's conv over the window ending at the token, its delta rule from the state
    and back into it."""

    def __init__(self, g, caches: dict, pos, masks: dict, sink_col, states=None):
        self.g, self.caches, self.pos, self.masks, self.sink_col, self.s = \
            g, caches, pos, masks, sink_col, states
        self.writes = []

    def attention(self, i, part, q, k, v, sinks, segments):
        """q [R, 1, H, hd]: with one token, token-major is heads-first, so reshapes are all
        it takes."""
        R, kv, hd = q.shape[0], part.kv_heads, part.head_dim
        kc, vc = (ops.cache_write(c, x.reshape(R, kv, 1, hd), self.pos)
                  for c, x in zip(self.caches[i], (k, v)))
        group = part.heads // kv
        # Query head h reads K/V head h // group: the group folded into the rows of a
        # batched matmul per (row, K/V head), [R, KV, group, hd] x [R, KV, L, hd]^T.
        scores = ops.matmul(q.reshape(R, kv, group, hd), kc, trans_b=True)
        scores = scores + self.masks[part.window]
        if sinks is not None:   # the sink row's score q.0 = 0 gets sinks[h]
            sinks = ops.scale(sinks.reshape(kv, group, 1), 1.0 / part.scale)
            scores = scores + ops.mul(sinks, self.sink_col)
        probs = ops.softmax(scores, scale=part.scale)
        return ops.matmul(probs, vc).reshape(R, 1, part.heads, hd)

    def conv(self, i, x, w):
        C, L = x.shape[2], self.s.cache_len
        rows = ops.cache_write(self.s.rows[i], x.reshape(1, 1, 1, C), self.pos).reshape(L, C)
        window = ops.matmul(self.s.select, rows)               # [width, C], zeros before row 0
        return ops.sum(window.permute(1, 0) * w, 1).reshape(1, 1, C)

    def delta(self, i, q, k, v, g, beta):
        o, state = ops.delta_rule(q, k, v, g, beta, state=self.s.states[i])
        self.writes.append(self.g.effect(ops.cache_write(self.s.states[i], state, self.s.zero),
                                         "forward"))
        return o
