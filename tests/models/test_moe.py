"""models/moe.py's expert LoRA: each expert's adapter reaches only the tokens routed to it,
and the gradients of every adapter (and of the input, through router and experts) agree
with f64 central differences."""
from types import SimpleNamespace

import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, forward_f64, rnd, weighted_sum
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.models.moe import moe_ffn
from toygraph.models.parts import Dense, Experts

N, D, E, K, F, R, S = 7, 8, 5, 2, 6, 3, 4


def _part(router, shared: bool = False):
    return Experts(count=E, used=K, width=F, router=router, norm_weights=True,
                   shared=Dense(S, "swiglu", "_shexp") if shared else None)


def _block(rng, x_param: bool, adapters: dict, router="topk_softmax", shared=False):
    """(graph, x, output [N, D], {name: (A, B)}) of one MoE FFN with expert adapters (and
    a shared expert: its weights drawn after the others', so the rest are the same)."""
    g = Graph()
    x = (g.param if x_param else g.const)("x", rnd(rng, N, D))
    W = {"blk.0.ffn_gate_inp.weight": g.const("router", rnd(rng, E, D))}
    for name, shape in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F))):
        W[f"blk.0.ffn_{name}_exps.weight"] = g.const(name, rnd(rng, *shape, s=0.5))
    shapes = (("gate_inp", (1, D)), ("gate", (S, D)), ("up", (S, D)), ("down", (D, S)))
    for name, shape in shapes if shared else ():
        W[f"blk.0.ffn_{name}_shexp.weight"] = g.const(name + "_shexp", rnd(rng, *shape))
    pairs = {name: (g.param(name + ".a", a), g.param(name + ".b", b))
             for name, (a, b) in adapters.items()}

    block = SimpleNamespace(   # what moe_ffn reads of models/block.Block
        proj=lambda h, name: ops.matmul(h, W[f"blk.0.{name}.weight"], trans_b=True),
        w=lambda name: W["blk.0." + name], get=lambda name: W.get("blk.0." + name),
        expert_adapter=lambda name: ((*pairs[f"blk.0.{name}.weight"], 0.7)
                                     if f"blk.0.{name}.weight" in pairs else None))
    out = moe_ffn(block, _part(router, shared), x)
    return g, x, out, pairs, W


def _adapters(rng, scale=1.0):
    return {"blk.0.ffn_gate_up_exps.weight": (rnd(rng, E, R, D), rnd(rng, E, 2 * F, R, s=scale)),
            "blk.0.ffn_down_exps.weight": (rnd(rng, E, R, F), rnd(rng, E, D, R, s=scale))}


@pytest.mark.parametrize("router", ["topk_softmax", "softmax_topk"])
def test_expert_lora_gradients_match_finite_differences(router):
    rng = np.random.default_rng(3)
    g, x, out, pairs, _ = _block(rng, True, _adapters(rng), router)
    params = [x] + [t for pair in pairs.values() for t in pair]
    assert check_gradients(g, weighted_sum(out, rng), params, {}) < TOL


def test_an_experts_adapter_reaches_only_the_tokens_routed_to_it():
    """Changing expert e's A and B changes exactly the rows of the tokens that chose e."""
    rng = np.random.default_rng(4)
    adapters = _adapters(rng)
    g, _, out, _, _ = _block(np.random.default_rng(9), False, adapters)
    g.output(out)
    ids = g.output(next(t for t in g.nodes if t.op == "topk"))
    s = forward_f64(g, {})
    base, chosen = s.download(out), s.download(ids)
    e = int(chosen[0, 0])
    assert 0 < (chosen == e).any(axis=1).sum() < N   # some tokens chose e, some did not
    for name, (a, b) in adapters.items():
        a, b = a.copy(), b.copy()
        a[e] += 1.0
        b[e] += 1.0
        changed = dict(adapters, **{name: (a, b)})
        g2, _, out2, _, _ = _block(np.random.default_rng(9), False, changed)
        g2.output(out2)
        moved = np.abs(forward_f64(g2, {}).download(out2) - base).max(axis=1) > 1e-9
        np.testing.assert_array_equal(moved, (chosen == e).any(axis=1), err_msg=name)


def test_the_shared_expert_adds_its_gated_output():
    """Experts.shared (Qwen2-MoE): each token's output gains sigmoid(x . w_gate) times the
    shared dense expert's down(silu(gate(x)) * up(x)), on top of the routed experts'."""
    outs = {}
    for shared in (False, True):
        g, x, out, _, W = _block(np.random.default_rng(5), False, {}, shared=shared)
        g.output(out)
        outs[shared] = forward_f64(g, {}).download(out)
    x = x.data.astype(np.float64)
    w = {name: t.data.astype(np.float64) for name, t in W.items() if "shexp" in name}
    gate, up = (x @ w[f"blk.0.ffn_{n}_shexp.weight"].T for n in ("gate", "up"))
    dense = (gate / (1 + np.exp(-gate)) * up) @ w["blk.0.ffn_down_shexp.weight"].T
    scale = 1 / (1 + np.exp(-(x @ w["blk.0.ffn_gate_inp_shexp.weight"].T)))   # [N, 1]
    assert scale.std() > 0.1   # the gate varies by token
    np.testing.assert_allclose(outs[True] - outs[False], scale * dense, rtol=1e-10, atol=1e-12)


def test_gradients_through_the_shared_expert_match_finite_differences():
    rng = np.random.default_rng(6)
    g, x, out, pairs, _ = _block(rng, True, _adapters(rng), shared=True)
    params = [x] + [t for pair in pairs.values() for t in pair]
    assert check_gradients(g, weighted_sum(out, rng), params, {}) < TOL
