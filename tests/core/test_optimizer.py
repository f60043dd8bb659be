"""AdamW, clipping and accumulation against an independent implementation; schedules."""
import math

import numpy as np
import pytest

from toygraph import ops
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.optimizer import Schedule, build_training, hp_row
from toygraph.core.session import Session


def tiny_problem(seed=0, n=8):
    rng = np.random.default_rng(seed)
    w1 = (rng.normal(size=(5, 7)) * 0.5).astype(np.float32)
    w2 = (rng.normal(size=(7, 3)) * 0.5).astype(np.float32)
    xs = rng.normal(size=(n, 5)).astype(np.float32)
    labs = rng.integers(0, 3, size=n).astype(np.int32)
    return w1, w2, xs, labs


def build(w1v, w2v, n, max_norm):
    g = Graph()
    x, lab = g.input("x", (n, 5)), g.input("lab", (n,), "i32")
    w1, w2 = g.param("w1", w1v), g.param("w2", w2v)
    logits = ops.silu(x @ w1) @ w2
    loss = g.output(ops.cross_entropy(logits, lab))
    step = build_training(ops.cross_entropy(logits, lab, reduction="sum"), [w1, w2],
                          count=ops.count_valid(lab), max_norm=max_norm)
    sess = Session(g, dtype="f64")
    sess.realize()
    return sess, x, lab, w1, w2, loss, step


def numpy_grads(w1, w2, xs, labs):
    """Hand-written forward/backward of the same MLP (mean CE over non-ignored labels)."""
    h = xs @ w1
    s = 1 / (1 + np.exp(-h))
    a = h * s
    z = a @ w2
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    valid = labs >= 0
    n = max(valid.sum(), 1)
    dz = p.copy()
    dz[np.arange(len(labs)), np.where(valid, labs, 0)] -= 1
    dz *= valid[:, None] / n
    dw2 = a.T @ dz
    da = dz @ w2.T
    dh = da * s * (1 + h * (1 - s))
    return xs.T @ dh, dw2


def reference_adamw(ws, grads, ms, vs, t, lr, b1, b2, eps, wd, max_norm):
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    coef = min(1.0, max_norm / norm) if max_norm > 0 else 1.0
    out = []
    for w, g, m, v in zip(ws, grads, ms, vs):
        g = g * coef
        m[:] = b1 * m + (1 - b1) * g
        v[:] = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        out.append(w * (1 - lr * wd) - lr * mh / (np.sqrt(vh) + eps))
    return out, norm


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_adamw_matches_handwritten_reference(max_norm):
    w1, w2, xs, labs = tiny_problem()
    labs[2] = -1
    sess, x, lab, t1, t2, loss, step = build(w1, w2, len(xs), max_norm)
    ws = [w1.astype(np.float64), w2.astype(np.float64)]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    lr, b1, b2, eps, wd = 0.05, 0.9, 0.95, 1e-8, 0.1
    sess.reset()
    clipped = 0
    for t in range(1, 6):
        sess.reset_grads()
        sess.upload(x, xs), sess.upload(lab, labs)
        sess.upload(step.hp, hp_row(t, lr, b1, b2, eps, wd))
        sess.run("step")
        grads = numpy_grads(*ws, xs, labs)
        ws, norm = reference_adamw(ws, grads, ms, vs, t, lr, b1, b2, eps, wd, max_norm)
        clipped += max_norm > 0 and norm > max_norm
        assert np.isclose(float(sess.download(step.grad_norm)), norm, rtol=1e-5)
        np.testing.assert_allclose(sess.download(t1), ws[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sess.download(t2), ws[1], rtol=1e-5, atol=1e-6)
    if max_norm:
        assert clipped >= 3  # the clipping path really ran


def test_adamw_matches_torch_if_available():
    torch = pytest.importorskip("torch")
    w1, w2, xs, labs = tiny_problem(1)
    sess, x, lab, t1, t2, loss, step = build(w1, w2, len(xs), max_norm=0.1)
    tw = [torch.tensor(w1, dtype=torch.float64, requires_grad=True),
          torch.tensor(w2, dtype=torch.float64, requires_grad=True)]
    opt = torch.optim.AdamW(tw, lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    sess.reset()
    for t in range(1, 5):
        sess.reset_grads()
        sess.upload(x, xs), sess.upload(lab, labs)
        sess.upload(step.hp, hp_row(t, 0.02, 0.9, 0.99, 1e-8, 0.05))
        sess.run("step")
        opt.zero_grad()
        h = torch.tensor(xs, dtype=torch.float64) @ tw[0]
        z = torch.nn.functional.silu(h) @ tw[1]
        torch.nn.functional.cross_entropy(z, torch.tensor(labs, dtype=torch.long)).backward()
        torch.nn.utils.clip_grad_norm_(tw, 0.1)
        opt.step()
        for mine, ref in ((t1, tw[0]), (t2, tw[1])):
            np.testing.assert_allclose(sess.download(mine), ref.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_accumulating_k_micro_batches_equals_one_big_batch():
    w1, w2, xs, labs = tiny_problem(2, n=12)
    labs[[1, 7, 8]] = -1  # uneven numbers of counted tokens per micro-batch
    big, x, lab, b1_, b2_, _, bstep = build(w1, w2, 12, 0.5)
    big.reset()
    big.upload(x, xs), big.upload(lab, labs), big.upload(bstep.hp, hp_row(1, 0.01))
    big.run("step")
    small, xs_, ls_, s1, s2, _, sstep = build(w1, w2, 4, 0.5)
    small.reset()
    for k in range(3):
        small.upload(xs_, xs[4 * k:4 * k + 4]), small.upload(ls_, labs[4 * k:4 * k + 4])
        small.upload(sstep.hp, hp_row(1, 0.01))
        small.run("backward" if k < 2 else "step")
    assert np.isclose(float(small.download(sstep.grad_norm)), float(big.download(bstep.grad_norm)),
                      rtol=1e-10)
    np.testing.assert_allclose(small.download(s1), big.download(b1_), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(small.download(s2), big.download(b2_), rtol=1e-10, atol=1e-12)


def test_hp_row_and_schedules():
    row = hp_row(3, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    assert row.dtype == np.float32 and row.shape == (9,)
    assert np.isclose(row[5], 1 / (1 - 0.9 ** 3)) and np.isclose(row[6], 1 / (1 - 0.999 ** 3))
    assert row[7] == 3 and row[8] == 0      # the step and micro-batch dropout is keyed by
    with pytest.raises(GraphError):
        hp_row(0, 1e-3)
    warm = Schedule(1e-3, "cosine", warmup=10, total=100, floor=1e-5)
    assert warm(1) == pytest.approx(1e-4) and warm(1) > 0   # step 1 is not a no-op
    assert warm(10) == pytest.approx(1e-3) and warm(11) == pytest.approx(1e-3)
    assert warm(56) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)  # halfway through the decay
    last = 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 89 / 90))
    assert warm(100) == pytest.approx(last) and warm(100) > 1e-5  # the last step still learns
    lin = Schedule(2e-3, "linear", warmup=0, total=10)
    assert lin(1) == pytest.approx(2e-3) and lin(10) == pytest.approx(2e-4)
    assert Schedule(5e-4)(1000) == 5e-4
    with pytest.raises(GraphError):
        Schedule(1e-3, "cosine", warmup=10, total=5)
    with pytest.raises(GraphError):
        Schedule(1e-3, "exponential")
