"""The mixture-of-experts ops (toygraph/core/ops/experts.py): top-k choice, grouping,
take_along and the per-expert matmul, against plain numpy loops, and every gradient
against f64 central differences (the routing weights' included; the choice is not
differentiated, as in the references)."""
import numpy as np
import pytest

from gradcheck import TOL, check_gradients, forward_f64, rnd, weighted_sum
from toygraph.core import ops
from toygraph.core.graph import Graph
from toygraph.errors import GraphError


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
