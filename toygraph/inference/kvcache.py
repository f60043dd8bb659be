"""Generation with a KV cache: a prefill graph and a one-token decode graph in one session.

>>> gen = CachedDecoder(model, prompt_len=16, cache_len=320)     # doctest: +SKIP
>>> row = gen.prefill(ids)               # logits after the prompt (len(ids) <= 16)
>>> row = gen.decode(token, len(ids))    # logits after `token`, placed at that position

Both graphs live in one Graph and one Session, so they share the weights (bound once) and
the cache: per layer a K and a V ``state`` tensor [1, n_head_kv, cache_len, head_dim] in
the session's memory plan, written in place by the ``cache_write`` op (ops/cache.py).
Each is realized once per (prompt_len, cache_len) and replayed as a session program.

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
from toygraph.core import ops
from toygraph.core.graph import Graph
from toygraph.core.ops.flash_attention import TOKEN_MAJOR
from toygraph.core.session import Session
from toygraph.models.decoder import build_decoder
from toygraph.models.deltanet import Recurrence

def heads_first(x):
    """Token-major keys or values [B, T, KV, hd] as the caches hold them, [B, KV, T, hd]."""
    return x.permute(0, 2, 1, 3)


#: The additive mask of rows a query may not see. Finite, because uploads refuse NaN and
#: inf; softmax subtracts the row maximum first, so these rows' weights are exactly 0.
MASKED = -1e30


class CachedDecoder:
    """The prefill and decode programs of one model for one (prompt_len, cache_len)."""

    def __init__(self, model, *, prompt_len: int, cache_len: int, backend: str = "cpu",
                 precision: str = "f32", lora=None, adapter=None):
        cfg = model.config
        self.cfg, self.cache_len = cfg, cache_len
        g = Graph()
        self.sink_row = cfg.family.sinks  # one extra, never-written row: the sink
        # Per layer [1, n_head_kv, cache_len (+ the sink row), head_dim] (Gemma 4 varies them
        # by layer; its KV-sharing layers cache their source layer's keys and values again).
        self.caches = {i: tuple(g.state(f"blk.{i}.cache_{kv}",
                                        (1, cfg.layer_kv_heads(i), cache_len + self.sink_row,
                                         cfg.layer_head_dim(i)), kind="cache") for kv in "kv")
                       for i in range(cfg.n_layer) if not cfg.layer_recurrent(i)}
        self.start = g.input("prefill.start", (1,), "i32")  # 0: the prompt fills rows [0, P)
        self.pos = g.input("decode.pos", (1,), "i32")       # the decode position again, [1]
        writes = []
        rec = _Recurrent(g, cfg, prompt_len, cache_len, self) if cfg.recurrent else None

        def prefill_attend(i, q, k, v, sinks):   # token-major q, k, v (build_decoder)
            writes.extend(g.effect(ops.cache_write(c, heads_first(x), self.start), "forward")
                          for c, x in zip(self.caches[i], (k, v)))
            return ops.attention(q, k, v, scale=cfg.attn_scale, causal=True,
                                 window=cfg.windows[i], sinks=sinks, layout=TOKEN_MAJOR,
                                 save_lse=False)

        self.first = build_decoder(g, cfg, batch=1, seq_len=prompt_len, model=model, lora=lora,
                                   attend=prefill_attend, recurrence=rec and rec.prefill)
        self.masks = {w: g.input(f"decode.mask{w}", (cache_len + self.sink_row,))
                      for w in set(cfg.windows)}
        if self.sink_row:   # 1 on the sink's row: times sinks[h] / scale, added to the scores
            self.sink_col = g.const("decode.sink_col", np.eye(cache_len + 1, dtype=np.float32)[-1])
        self.step = build_decoder(g, cfg, batch=1, seq_len=1, lora=lora, shared=self.first,
                                  prefix="decode.", attend=self._decode_attend,
                                  recurrence=rec and rec.decode)
        for net in (self.first, self.step):
            g.output(net.logits)
        self.recurrent = rec
        self.sess = Session(g, backend=backend, precision=precision)
        self.sess.realize()
        load_lora(self.sess, self.first, adapter or {})
        self.prefill_program = self.sess.program([self.first.logits] + writes
                                                 + (rec.prefill.writes if rec else []))
        self.decode_program = self.sess.program([self.step.logits]
                                                + (rec.decode.writes if rec else []))

    def _decode_attend(self, i, q, k, v, sinks):
        """Layer i's attention of the one new token over the cache (q [1, 1, H, hd]: with
        one token, token-major is heads-first, so reshapes are all it takes)."""
        cfg = self.cfg
        kv, hd = cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
        kc, vc = (ops.cache_write(c, x.reshape(1, kv, 1, hd), self.pos)
                  for c, x in zip(self.caches[i], (k, v)))
        group = cfg.n_head // kv
        # Query head h reads K/V head h // group: fold the group into the rows of a
        # batched matmul per K/V head, [1, KV, group, hd] x [1, KV, L, hd]^T.
        scores = ops.matmul(q.reshape(1, kv, group, hd), kc, trans_b=True)
        scores = scores + self.masks[cfg.windows[i]]
        if sinks is not None:
            sinks = ops.scale(sinks.reshape(kv, group, 1), 1.0 / cfg.attn_scale)
            scores = scores + ops.mul(sinks, self.sink_col)
        probs = ops.softmax(scores, scale=cfg.attn_scale)
        return ops.matmul(probs, vc).reshape(1, 1, cfg.n_head, hd)

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
    """The DeltaNet layers' states and their prefill and decode Recurrences (see above)."""

    def __init__(self, g, cfg, prompt_len: int, cache_len: int, owner: CachedDecoder):
        ssm = cfg.ssm
        self.width, self.cache_len = ssm.conv, cache_len
        layers = [i for i in range(cfg.n_layer) if cfg.layer_recurrent(i)]
        self.rows = {i: g.state(f"blk.{i}.conv_rows", (1, 1, cache_len, ssm.channels), kind="cache")
                     for i in layers}
        shape = (1, ssm.v_heads, ssm.k_dim, ssm.v_dim)
        self.states = {i: g.state(f"blk.{i}.delta_state", shape, kind="cache") for i in layers}
        self.zero_state = g.const("delta_state.zero", np.zeros(shape, np.float32))
        self.valid = g.input("prefill.valid", (1, prompt_len, 1))      # 1 on the prompt's tokens
        self.select = g.input("decode.conv_rows", (ssm.conv, cache_len))  # one-hot window rows
        self.zero = g.input("decode.zero", (1,), "i32")
        self.prefill = CachePrefill(self, g, owner.start)
        self.decode = CacheDecode(self, g, owner.pos)

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


class CachePrefill(Recurrence):
    def __init__(self, states: _Recurrent, g, start):
        self.s, self.g, self.start, self.writes = states, g, start, []

    def conv(self, i, x, w):
        B, T, C = x.shape   # B: 1 here, the rows of batched generation (batched.py)
        self.writes.append(self.g.effect(ops.cache_write(self.s.rows[i], x.reshape(B, 1, T, C),
                                                         self.start), "forward"))
        return ops.causal_conv1d(x, w)

    def delta(self, i, q, k, v, g, beta):
        o, state = ops.delta_rule(q, k, v, g * self.s.valid, beta * self.s.valid,
                                  state=self.s.zero_state)
        self.writes.append(self.g.effect(ops.cache_write(self.s.states[i], state, self.start),
                                         "forward"))
        return o


class CacheDecode(Recurrence):
    def __init__(self, states: _Recurrent, g, pos):
        self.s, self.g, self.pos, self.writes = states, g, pos, []

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
