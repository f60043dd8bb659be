"""Across the op families: compositions of several ops checked by f64 finite differences
(an attention block, a two-layer MLP with cross-entropy), and the build-time errors that
name the op and its operands. Each family's own tests are tests/ops/test_ops_<family>.py."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from toygraph import ops
from toygraph.errors import GraphError
from toygraph.core.graph import Graph


def test_composite_attention_block_gradient():
    """Q/K/V projections, rope, grouped-query causal attention, output projection."""
    rng = np.random.default_rng(9)
    B, T, D, H, KV, hd = 2, 4, 8, 4, 2, 2
    g = Graph()
    x = g.param("x", rnd(rng, B, T, D))
    wq, wk = g.param("wq", rnd(rng, H * hd, D, s=0.5)), g.param("wk", rnd(rng, KV * hd, D, s=0.5))
    wv, wo = g.param("wv", rnd(rng, KV * hd, D, s=0.5)), g.param("wo", rnd(rng, D, H * hd, s=0.5))
    pos = g.input("pos", (B, T), "i32")
    xn = ops.rms_norm(x, 1e-5)
    q = ops.matmul(xn, wq, trans_b=True).reshape(B, T, H, hd).rope(pos, hd, 10000.0)
    k = ops.matmul(xn, wk, trans_b=True).reshape(B, T, KV, hd).rope(pos, hd, 10000.0)
    v = ops.matmul(xn, wv, trans_b=True).reshape(B, T, KV, hd)
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    att = ops.matmul(q, k, trans_b=True).softmax(scale=hd ** -0.5, causal=True)
    o = ops.matmul(att, v).permute(0, 2, 1, 3).reshape(B, T, H * hd)
    y = ops.matmul(o, wo, trans_b=True) + x
    posv = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    err = check_gradients(g, weighted_sum(y, rng), [x, wq, wk, wv, wo], {pos: posv})
    assert err <= TOL


def test_composite_two_layer_mlp_with_cross_entropy():
    rng = np.random.default_rng(10)
    g = Graph()
    x = g.input("x", (6, 4))
    lab = g.input("lab", (6,), "i32")
    w1, b1 = g.param("w1", rnd(rng, 4, 8)), g.param("b1", rnd(rng, 8))
    w2, b2 = g.param("w2", rnd(rng, 8, 3)), g.param("b2", rnd(rng, 3))
    logits = ops.silu(x @ w1 + b1) @ w2 + b2
    loss = ops.cross_entropy(logits, lab)
    err = check_gradients(g, loss, [w1, b1, w2, b2],
                          {x: rnd(rng, 6, 4), lab: np.array([0, 2, 1, -1, 2, 0], np.int32)})
    assert err <= TOL


# --- build-time checks ---------------------------------------------------------------------
def test_shape_errors_name_op_and_operands():
    g = Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (5, 6))
    with pytest.raises(GraphError, match=r"matmul\(a \(3, 4\) f32, b \(5, 6\) f32\): inner"):
        a @ b
    with pytest.raises(GraphError, match="add.*do not broadcast"):
        a + b
    ids = g.input("ids", (3,), "i32")
    with pytest.raises(GraphError, match="get_rows"):
        ops.get_rows(ids, a)
    with pytest.raises(GraphError, match="reshape"):
        a.reshape(5, 3)
    with pytest.raises(GraphError, match="causal"):
        ops.softmax(a, causal=True)
    with pytest.raises(GraphError, match="rope"):
        ops.rope(a, ids, dims=4, base=1e4)
    with pytest.raises(GraphError, match="already exists"):
        g.input("a", (1,))
    with pytest.raises(GraphError, match="dtype"):
        g.input("c", (1,), "f16")
