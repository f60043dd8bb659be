"""dropout (ops/stochastic/): the counter-based mask. Its statistics (keep rate, the
1/(1-p) scale), its keys (step, micro-batch, salt, seed: same key same mask, another key
another), evaluation (step 0) as the identity, the backward's same mask, f64 finite
differences, and the CUDA kernel on the host executor drawing the same bits as numpy."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from support.hostparity import compare_op, run_phase
from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.ops.stochastic import HP_MICRO, HP_STEP
from toygraph.ops.stochastic.numpy import keep_mask
from toygraph.core.optimizer import HP_SIZE, hp_row
from toygraph.core.session import Session


def _row(step, micro=0):
    row = np.zeros(HP_SIZE, np.float32)
    row[HP_STEP], row[HP_MICRO] = step, micro
    return row


def _drop(xv, row, p=0.25, seed=42, salt=7, backend="cpu"):
    g = Graph()
    x, hp = g.const("x", xv), g.input("hp", (HP_SIZE,))
    y = g.output(ops.dropout(x, hp, p=p, seed=seed, salt=salt))
    return run_phase(g, backend, {hp: row}, "forward", [y])[0]


def test_hp_row_carries_the_step_and_a_micro_batch_slot():
    row = hp_row(5, 1e-3)
    assert row.shape == (HP_SIZE,) and row[HP_STEP] == 5 and row[HP_MICRO] == 0


def test_keep_rate_and_scale():
    p, n = 0.3, 200_000
    x = np.ones(n, np.float32) * 1.5
    y = _drop(x, _row(3), p=p)
    kept = y != 0
    # the keep rate within 5 standard deviations of 1 - p
    assert abs(kept.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_array_equal(y[kept], np.float32(1.5) * np.float32(1 / (1 - p)))
    np.testing.assert_array_equal(kept, keep_mask(n, p, 42, 7, 3, 0))


def test_same_key_same_mask_and_every_key_part_changes_it():
    x = np.ones(4096, np.float32)
    base = _drop(x, _row(3, 1)) != 0
    assert np.array_equal(base, _drop(x, _row(3, 1)) != 0)          # reproducible
    for other in (_drop(x, _row(4, 1)), _drop(x, _row(3, 0)), _drop(x, _row(3, 1), salt=8),
                  _drop(x, _row(3, 1), seed=43)):
        same = ((other != 0) == base).mean()
        assert 0.5 < same < 0.75      # independent masks agree on ~ p^2 + (1-p)^2 = 0.625


def test_step_zero_is_the_identity():
    x = rnd(np.random.default_rng(0), 3, 50)
    np.testing.assert_array_equal(_drop(x, _row(0)), x)


def test_backward_applies_the_same_mask():
    rng = np.random.default_rng(1)
    g = Graph()
    x, hp = g.param("x", rnd(rng, 6, 40)), g.input("hp", (HP_SIZE,))
    r = rnd(rng, 6, 40)
    y = g.output(ops.dropout(x, hp, p=0.5, seed=1, salt=2))
    grads = accumulate_grads(backward(ops.sum(y * g.const("r", r)), [x]))
    yv, dx = run_phase(g, "cpu", {hp: _row(9)}, "backward", [y, grads[x]])
    keep = keep_mask(240, 0.5, 1, 2, 9, 0).reshape(6, 40)
    assert np.array_equal(yv != 0, keep)
    np.testing.assert_array_equal(dx, np.where(keep, r * np.float32(2.0), 0))


def test_gradient_finite_differences():
    rng = np.random.default_rng(2)
    g = Graph()
    x, hp = g.param("x", rnd(rng, 4, 9)), g.input("hp", (HP_SIZE,))
    y = ops.dropout(ops.silu(x), hp, p=0.4, seed=3, salt=4) * x
    assert check_gradients(g, weighted_sum(y, rng), [x], {hp: _row(2, 1)}) <= TOL


@pytest.mark.parametrize("shape,p,step,micro", [((7, 300), 0.1, 1, 0), ((3, 5, 33), 0.5, 77, 3),
                                                ((5000,), 0.9, 123456, 1)])
def test_cuda_kernel_draws_the_numpy_bits(shape, p, step, micro, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")

    def inputs(g, rng):
        return {g.input("hp", (HP_SIZE,)): _row(step, micro)}
    got = compare_op(lambda x, hp: ops.dropout(x, hp, p=p, seed=2024, salt=0xDEADBEEF),
                     [shape], 0.0, inputs_fn=inputs, grad_tol=0.0)   # 0: bit-identical
    assert (got[0] == 0).any() and (got[0] != 0).any()


def test_bad_arguments_are_refused():
    g = Graph()
    x = g.const("x", np.ones((2, 3)))
    with pytest.raises(Exception, match=r"dropout probability must be in \[0, 1\)"):
        ops.dropout(x, g.input("hp", (HP_SIZE,)), p=1.0, seed=0, salt=0)
    with pytest.raises(Exception, match="reads the step from the hp row"):
        ops.dropout(x, g.input("short", (3,)), p=0.1, seed=0, salt=0)
