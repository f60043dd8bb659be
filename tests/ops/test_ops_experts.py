"""The mixture-of-experts ops (toygraph/ops/experts/): top-k choice, grouping,
take_along and the per-expert matmul, against plain numpy loops, and every gradient
against f64 central differences (the routing weights' included; the choice is not
differentiated, as in the references)."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, forward_f64, rnd, weighted_sum
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.buffer_plan import aligned
from toygraph.core.session import Session
from toygraph.errors import GraphError
from toygraph.cpu import block_tensor as decode
from toygraph.gguf import block_encode


def distinct_ids(rng, n, k, n_expert):
    """[n, k] expert ids, distinct per row (what topk gives), expert 0 never chosen so
    an unused expert is exercised."""
    return np.stack([rng.choice(np.arange(1, n_expert), k, replace=False) for _ in range(n)]
                    ).astype(np.int32)


def test_topk_is_largest_first_and_ties_go_to_the_lower_index():
    g = Graph()
    x = g.input("x", (3, 5))
    ids = g.output(ops.topk(x, 3))
    vals = np.array([[0.1, 0.5, -1, 2, 0.5], [1, 1, 1, 1, 1], [-3, -2, -1, -4, -5]], np.float32)
    s = forward_f64(g, {x: vals})
    np.testing.assert_array_equal(s.download(ids), [[3, 1, 4], [0, 1, 2], [2, 1, 0]])
    assert ids.dtype == "i32"


def test_grouping_is_stable_by_expert_then_slot():
    rng = np.random.default_rng(0)
    ids_v = rng.integers(0, 5, size=(7, 2)).astype(np.int32)
    g = Graph()
    ids = g.input("ids", (7, 2), "i32")
    routes = g.output(ops.group_by_expert(ids, 6))
    got = forward_f64(g, {ids: ids_v}).download(routes)
    flat = ids_v.ravel()
    want_perm = [r for e in range(6) for r in range(flat.size) if flat[r] == e]
    want_off = np.concatenate([[0], np.cumsum([np.sum(flat == e) for e in range(6)])])
    np.testing.assert_array_equal(got[:7], want_off)
    np.testing.assert_array_equal(got[7:], want_perm)


@pytest.mark.parametrize("x_slots", [False, True])
@pytest.mark.parametrize("trans_b", [True, False])
def test_expert_matmul_is_each_slots_expert_product(x_slots, trans_b):
    rng = np.random.default_rng(1)
    N, k, E, n_in, n_out = 5, 2, 4, 6, 3
    ids_v = distinct_ids(rng, N, k, E)
    xv = rnd(rng, *((N, k, n_in) if x_slots else (N, n_in)))
    wv = rnd(rng, *((E, n_out, n_in) if trans_b else (E, n_in, n_out)))
    g = Graph()
    ids = g.input("ids", (N, k), "i32")
    y = g.output(ops.expert_matmul(g.const("x", xv), g.const("w", wv),
                                   ops.group_by_expert(ids, E), trans_b=trans_b))
    got = forward_f64(g, {ids: ids_v}).download(y)
    for n in range(N):
        for j in range(k):
            we = wv[ids_v[n, j]].astype(np.float64)
            xr = (xv[n, j] if x_slots else xv[n]).astype(np.float64)
            np.testing.assert_allclose(got[n, j], xr @ (we.T if trans_b else we), rtol=1e-12)


@pytest.mark.parametrize("x_slots", [False, True])
@pytest.mark.parametrize("trans_b", [True, False])
def test_expert_matmul_gradients(x_slots, trans_b):
    rng = np.random.default_rng(2)
    N, k, E, n_in, n_out = 6, 2, 5, 4, 3
    g = Graph()
    x = g.param("x", rnd(rng, *((N, k, n_in) if x_slots else (N, n_in))))
    w = g.param("w", rnd(rng, *((E, n_out, n_in) if trans_b else (E, n_in, n_out))))
    ids = g.input("ids", (N, k), "i32")
    y = ops.expert_matmul(x, w, ops.group_by_expert(ids, E), trans_b=trans_b)
    err = check_gradients(g, weighted_sum(y, rng), [x, w], {ids: distinct_ids(rng, N, k, E)})
    assert err < TOL


def test_take_along_gradient():
    rng = np.random.default_rng(3)
    g = Graph()
    x = g.param("x", rnd(rng, 2, 3, 6))
    ids = g.input("ids", (2, 3, 2), "i32")
    y = ops.take_along(x, ids)
    ids_v = np.stack([distinct_ids(rng, 3, 2, 6) for _ in range(2)])
    assert check_gradients(g, weighted_sum(y, rng), [x], {ids: ids_v}) < TOL


@pytest.mark.parametrize("order", ["softmax_then_topk", "topk_then_softmax"])
def test_routing_weights_gradient_through_the_chosen_logits(order):
    """Both families' weightings: the gradient reaches every chosen logit (and, through
    softmax over all experts, the unchosen ones too), the choice is held fixed."""
    rng = np.random.default_rng(4)
    N, E, k, D = 5, 6, 2, 3
    g = Graph()
    logits = g.param("logits", rnd(rng, N, E, s=2.0))
    y = g.const("y", rnd(rng, N, k, D))
    if order == "softmax_then_topk":   # take_along(softmax) (Qwen3-MoE, no renormalisation)
        probs = ops.softmax(logits)
        w = ops.take_along(probs, ops.topk(probs, k))
    else:                              # softmax over the k chosen logits (gpt-oss; Qwen3 norm)
        w = ops.softmax(ops.take_along(logits, ops.topk(logits, k)))
    out = ops.sum(ops.mul(y, w.reshape(N, k, 1)), 1)
    assert check_gradients(g, weighted_sum(out, rng), [logits], {}) < TOL


def test_moe_block_gradient_reaches_the_input_through_router_and_experts():
    """x -> router -> top-2 weights, x -> gated experts -> weighted sum: d/dx has both."""
    rng = np.random.default_rng(5)
    N, D, E, k, F = 7, 8, 5, 2, 6
    g = Graph()
    x = g.param("x", rnd(rng, N, D))
    router = g.const("router", rnd(rng, E, D))
    wg, wu, wd = (g.const(n, rnd(rng, *s, s=0.5)) for n, s in
                  (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F))))
    logits = ops.matmul(x, router, trans_b=True)
    ids = ops.topk(logits, k)
    w = ops.softmax(ops.take_along(logits, ids))
    routes = ops.group_by_expert(ids, E)
    h = ops.swiglu(ops.expert_matmul(x, wg, routes), ops.expert_matmul(x, wu, routes))
    out = ops.sum(ops.mul(ops.expert_matmul(h, wd, routes), w.reshape(N, k, 1)), 1)
    assert check_gradients(g, weighted_sum(out, rng), [x], {}) < TOL


def test_shape_errors_name_the_operands():
    g = Graph()
    x = g.input("x", (4, 8))
    ids = g.input("ids", (4, 2), "i32")
    w = g.const("w", np.zeros((3, 5, 7), np.float32))
    with pytest.raises(GraphError, match=r"expert_matmul\(x .*x must be \[N, 7\]"):
        ops.expert_matmul(x, w, ops.group_by_expert(ids, 3))
    with pytest.raises(GraphError, match="topk needs 1 <= k <= 8"):
        ops.topk(x, 9)


# --- expert weights kept in their block format (core/frozen_base.py "quantized") ------------
def _block_expert_graph(qtype, E=6, N=5, k=2, n_in=256, n_out=32):
    """y = x @ W[e]^T and the dx-style dy @ W[e] over block-format expert weights, experts
    0 and E-1 chosen by no token."""
    rng = np.random.default_rng(4)
    ids_v = np.stack([rng.choice(np.arange(1, E - 1), k, replace=False) for _ in range(N)]
                     ).astype(np.int32)
    wv = (rng.standard_normal((E, n_out, n_in)) * 0.05).astype(np.float32)
    g = Graph()
    w = g.const("w", block_encode.quantize(wv, qtype), shape=wv.shape, storage=qtype)
    x, dy = g.input("x", (N, n_in)), g.input("dy", (N, k, n_out))
    ids = g.input("ids", (N, k), "i32")
    routes = ops.group_by_expert(ids, E)
    outs = [g.output(ops.expert_matmul(x, w, routes)),
            g.output(ops.expert_matmul(dy, w, routes, trans_b=False))]
    feed = {x: rng.standard_normal((N, n_in)), dy: rng.standard_normal((N, k, n_out)),
            ids: ids_v}
    return g, w, outs, feed, set(ids_v.ravel().tolist())


def _run_block_graph(g, outs, feed, mode):
    sess = Session(g, base_memory=mode)
    sess.realize()
    for t, v in feed.items():
        sess.upload(t, v)
    sess.run("forward")
    return sess, [sess.download(t) for t in outs]


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_quantized_experts_decode_only_the_chosen_ones_bit_for_bit(qtype, monkeypatch):
    """The numpy backend's block kernel (its numpy kernels: the engine's replay multiplies
    on the chosen experts' blocks instead, tests/cpu/test_cpu_replay_moe_deltanet.py)."""
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", "numpy")
    g, w, outs, feed, chosen = _block_expert_graph(qtype)
    _, ref = _run_block_graph(g, outs, feed, "decode")
    parts, whole = [], []
    plain_part, plain_decode = decode.BlockTensor.part, decode.BlockTensor.decode_into

    def part(self, i):
        parts.append(i)
        return plain_part(self, i)

    def decode_into(self, out):
        whole.append(self.shape)
        return plain_decode(self, out)

    sparse = []
    monkeypatch.setattr(decode.BlockTensor, "part", part)
    monkeypatch.setattr(decode.BlockTensor, "decode_into", decode_into)
    monkeypatch.setattr(decode.BlockTensor, "read_sparsely", lambda self: sparse.append(self.shape))
    sess, got = _run_block_graph(g, outs, feed, "quantized")
    assert sparse == [w.shape] * 2   # each node advises the stacked experts it reads
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    # per node each chosen expert twice (its prefetch, then its decode), in expert order;
    # only expert-sized decodes, never the stacked tensor
    assert parts == sorted(chosen) * 4 and set(whole) == {w.shape[1:]}
    assert len(whole) == 2 * len(chosen)
    plan = sess.plan
    assert plan.quantized == {w.id} and plan.scratch_bytes == aligned(4 * 32 * 256)


def test_an_expert_slice_decodes_to_that_expert_of_the_whole():
    rng = np.random.default_rng(5)
    wv = rng.standard_normal((3, 4, 256)).astype(np.float32)
    t = decode.BlockTensor(block_encode.quantize(wv, "q4_k"), "q4_k", wv.shape)
    whole = t.decode_into(np.empty(wv.shape, np.float32))
    for e in range(3):
        part = t.part(e)
        assert part.shape == (4, 256) and np.shares_memory(part.data, t.data)
        np.testing.assert_array_equal(part.decode_into(np.empty((4, 256), np.float32)), whole[e])
