"""The loss ops (ops/loss/), numpy side: cross_entropy's f64 finite-difference gradient,
values and all-ignored rows; linear_cross_entropy (the fused head + loss) against the
unfused head in one chunk and in chunks of 2 rows, its packed backward, no vocabulary-sized
rows, shape errors and label checks at upload."""
import numpy as np
import pytest

from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from toygraph import ops
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.session import Session


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_gradient_with_ignored(reduction):
    rng = np.random.default_rng(7)
    g = Graph()
    logits = g.param("logits", rnd(rng, 5, 6, s=2.0))
    lab = g.input("lab", (5,), "i32")
    loss = ops.cross_entropy(logits, lab, reduction=reduction)
    labv = np.array([1, -1, 5, 0, -1], np.int32)
    assert check_gradients(g, loss, [logits], {lab: labv}) <= TOL


def test_cross_entropy_values_and_all_ignored():
    rng = np.random.default_rng(8)
    lv = rnd(rng, 4, 5)
    labv = np.array([2, -1, 0, 4], np.int32)
    g = Graph()
    logits = g.param("logits", lv)
    lab = g.input("lab", (4,), "i32")
    loss = g.output(ops.cross_entropy(logits, lab))
    from toygraph.core.autodiff import accumulate_grads, backward
    accumulate_grads(backward(loss, [logits]))
    s = Session(g, dtype="f64"); s.realize(); s.reset()
    s.upload(lab, labv); s.run("backward")
    lp = lv - np.log(np.exp(lv).sum(1, keepdims=True))
    want = -np.mean([lp[0, 2], lp[2, 0], lp[3, 4]])
    assert np.isclose(float(s.download(loss)), want, rtol=1e-6)
    s.reset(); s.upload(lab, np.full(4, -1, np.int32)); s.run("backward")
    assert float(s.download(loss)) == 0.0
    assert not np.any(s.download(g.find("grad.logits")))


# --- fused output head + cross-entropy ------------------------------------------------------------
LCE_LABELS = {  # N = 7 rows over a vocabulary of 9
    "some_ignored": [1, -1, 8, 0, -1, 3, 3],
    "none_ignored": [2, 5, 0, 8, 1, 1, 4],
    "all_ignored": [-1] * 7,
}


@pytest.fixture(params=[128, 2], ids=["one_chunk", "chunks_of_2"])
def lce_rows(request, monkeypatch):
    """The numpy kernels' chunk size: the default, and 2 rows, so the rows split into
    several chunks (and a ragged last one) even here."""
    from toygraph.ops.loss import numpy as loss
    monkeypatch.setattr(loss, "LCE_ROWS", request.param)
    return request.param


@pytest.mark.parametrize("labels", list(LCE_LABELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_gradients(reduction, labels, lce_rows):
    rng = np.random.default_rng(21)
    g = Graph()
    h, w = g.param("h", rnd(rng, 7, 5)), g.param("w", rnd(rng, 9, 5))
    lab = g.input("lab", (7,), "i32")
    loss = ops.linear_cross_entropy(h, w, lab, reduction=reduction)
    labv = np.array(LCE_LABELS[labels], np.int32)
    err = check_gradients(g, loss, [h, w], {lab: labv})
    if labels == "all_ignored":
        assert err == 0.0   # zero loss, zero gradients, zero finite differences
    else:
        assert err <= TOL


def _lce_run(fused, hv, wv, labv, reduction, params=("h", "w")):
    from toygraph.core.autodiff import accumulate_grads, backward
    g = Graph()
    h = g.param("h", hv) if "h" in params else g.const("h", hv)
    w = g.param("w", wv) if "w" in params else g.const("w", wv)
    lab = g.input("lab", labv.shape, "i32")
    if fused:
        loss = ops.linear_cross_entropy(h, w, lab, reduction=reduction)
    else:
        loss = ops.cross_entropy(ops.matmul(h, w, trans_b=True), lab, reduction=reduction)
    g.output(loss)
    ps = [t for t in (h, w) if t.role == "param"]
    accumulate_grads(backward(loss, ps))
    s = Session(g, dtype="f64"); s.realize(); s.reset()
    s.upload(lab, labv); s.run("backward")
    return g, [s.download(loss)] + [s.download(g.find(f"grad.{p.name}")) for p in ps]


@pytest.mark.parametrize("labels", list(LCE_LABELS) + ["long"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_equals_the_unfused_head(reduction, labels, lce_rows):
    """Loss, dh and dw against cross_entropy(matmul(h, w^T)) in f64, within 1e-12."""
    rng = np.random.default_rng(22)
    N = 150 if labels == "long" else 7
    hv, wv = rng.normal(size=(N, 6)), rng.normal(size=(11, 6)) * 2
    labv = (rng.integers(-1, 11, size=N) if labels == "long"
            else np.minimum(LCE_LABELS[labels], 10)).astype(np.int32)
    _, fused = _lce_run(True, hv, wv, labv, reduction)
    _, plain = _lce_run(False, hv, wv, labv, reduction)
    for what, a, b in zip(["loss", "dh", "dw"], fused, plain):
        assert np.abs(a - b).max() <= 1e-12 * max(np.abs(b).max(), 1.0), what
    if labels == "all_ignored":
        assert float(fused[0]) == 0.0 and not fused[1].any() and not fused[2].any()


@pytest.mark.parametrize("labels", list(LCE_LABELS))
def test_linear_cross_entropy_per_row_gradients(labels, lce_rows):
    """reduction="none": [N] row losses under a weighted sum, so every row's own gradient
    weight matters; f64 finite differences for h and w."""
    rng = np.random.default_rng(25)
    g = Graph()
    h, w = g.param("h", rnd(rng, 7, 5)), g.param("w", rnd(rng, 9, 5))
    lab = g.input("lab", (7,), "i32")
    loss = weighted_sum(ops.linear_cross_entropy(h, w, lab, reduction="none"), rng)
    err = check_gradients(g, loss, [h, w], {lab: np.array(LCE_LABELS[labels], np.int32)})
    assert err == 0.0 if labels == "all_ignored" else err <= TOL


@pytest.mark.parametrize("labels", ["some_ignored", "all_ignored", "long"])
def test_linear_cross_entropy_per_row_is_minus_token_logprobs(labels, lce_rows):
    """-linear_cross_entropy(h, w, labels, "none") against token_logprobs of the unfused
    head in f64: the per-row values (0 on ignored rows), dh and dw under a weighted sum,
    within 1e-12."""
    from toygraph.core.autodiff import accumulate_grads, backward
    rng = np.random.default_rng(26)
    N = 150 if labels == "long" else 7
    hv, wv = rng.normal(size=(N, 6)), rng.normal(size=(11, 6)) * 2
    labv = (rng.integers(-1, 11, size=N) if labels == "long"
            else np.minimum(LCE_LABELS[labels], 10)).astype(np.int32)
    r = rng.normal(size=N)
    runs = []
    for fused in (True, False):
        g = Graph()
        h, w = g.param("h", hv), g.param("w", wv)
        lab = g.input("lab", (N,), "i32")
        lp = (ops.scale(ops.linear_cross_entropy(h, w, lab, reduction="none"), -1.0) if fused
              else ops.token_logprobs(ops.matmul(h, w, trans_b=True), lab))
        g.output(lp)
        loss = g.output(ops.sum(ops.mul(lp, g.const("r", r))))
        accumulate_grads(backward(loss, [h, w]))
        s = Session(g, dtype="f64"); s.realize(); s.reset()
        s.upload(lab, labv); s.run("backward")
        runs.append([s.download(lp), s.download(g.find("grad.h")), s.download(g.find("grad.w"))])
    for what, a, b in zip(["logprobs", "dh", "dw"], *runs):
        assert np.abs(a - b).max() <= 1e-12 * max(np.abs(b).max(), 1.0), what
    assert not runs[0][0][labv < 0].any()
    if labels == "all_ignored":
        assert not any(x.any() for x in runs[0])


def test_linear_cross_entropy_backward_packs_dw_only_when_w_trains():
    """A frozen head (LoRA) gets no dw: the backward node holds dh alone."""
    from toygraph.core.autodiff import backward
    rng = np.random.default_rng(23)
    for trainable in (("h", "w"), ("h",), ("w",)):
        g = Graph()
        h = g.param("h", rnd(rng, 7, 5)) if "h" in trainable else g.const("h", rnd(rng, 7, 5))
        w = g.param("w", rnd(rng, 9, 5)) if "w" in trainable else g.const("w", rnd(rng, 9, 5))
        lab = g.input("lab", (7,), "i32")
        ps = [t for t in (h, w) if t.role == "param"]
        grads = backward(ops.linear_cross_entropy(h, w, lab), ps)
        backs = {t.srcs[0] for t in grads.values()}
        assert [t.op for t in grads.values()] == ["unpack"] * len(ps)
        (back,) = backs
        assert back.op == "linear_cross_entropy_back"
        assert back.shape == (sum(p.size for p in ps),)
        assert (back.attrs["grad_h"], back.attrs["grad_w"]) == ("h" in trainable, "w" in trainable)
        assert [t.attrs["offset"] for t in grads.values()] == [0, h.size][:len(ps)] \
            if len(ps) == 2 else [0]
    # LoRA-style: only dh, and the values still match the unfused head.
    hv, wv = rng.normal(size=(7, 5)), rng.normal(size=(9, 5))
    labv = np.array(LCE_LABELS["some_ignored"], np.int32)
    _, fused = _lce_run(True, hv, wv, labv, "sum", params=("h",))
    _, plain = _lce_run(False, hv, wv, labv, "sum", params=("h",))
    assert np.abs(fused[1] - plain[1]).max() <= 1e-12 * np.abs(plain[1]).max()


def test_linear_cross_entropy_never_builds_vocabulary_sized_rows(lce_rows, monkeypatch):
    """No array with N * V elements (or [N, V]) is made, forward or backward."""
    from toygraph.ops.loss import numpy as loss_ops
    N, D, V = 150, 4, 13
    seen = []
    real_matmul = np.matmul

    def spy(a, b, *args, **kw):
        r = real_matmul(a, b, *args, **kw)
        seen.append(np.shape(r))
        return r
    monkeypatch.setattr(loss_ops.np, "matmul", spy)
    rng = np.random.default_rng(24)
    _lce_run(True, rng.normal(size=(N, D)), rng.normal(size=(V, D)),
             rng.integers(0, V, size=N).astype(np.int32), "mean")
    assert seen and all(s[0] <= lce_rows for s in seen if s[-1] == V)


def test_linear_cross_entropy_shape_errors():
    g = Graph()
    h, w, lab = g.input("h", (4, 3)), g.input("w", (6, 3)), g.input("lab", (4,), "i32")
    with pytest.raises(GraphError, match="linear_cross_entropy.*h must be"):
        ops.linear_cross_entropy(h, g.input("w2", (6, 5)), lab)
    with pytest.raises(GraphError, match="labels must be"):
        ops.linear_cross_entropy(h, w, g.input("lab2", (5,), "i32"))
    with pytest.raises(GraphError, match="i32 labels"):
        ops.linear_cross_entropy(h, w, g.input("lab3", (4,)))
    with pytest.raises(GraphError, match="reduction"):
        ops.linear_cross_entropy(h, w, lab, reduction="max")
    per_row = ops.linear_cross_entropy(h, w, lab, reduction="none")
    assert per_row.shape == (4,)
    with pytest.raises(GraphError, match=r"loss gradient must be f32 \[4\]"):
        g.node("linear_cross_entropy_back", [h, w, lab, g.input("g", ())],
               dict(reduction="none", grad_h=True, grad_w=False))


def test_linear_cross_entropy_labels_are_checked_at_upload():
    """-1 is allowed, a label at or past the head's vocabulary is refused on the host."""
    g = Graph()
    h, w = g.param("h", np.ones((3, 2), np.float32)), g.const("w", np.ones((5, 2)))
    lab = g.input("lab", (3,), "i32")
    g.output(ops.linear_cross_entropy(h, w, lab))
    s = Session(g); s.realize()
    s.upload(lab, np.array([-1, 0, 4], np.int32))
    with pytest.raises(GraphError, match=r"value 5 outside \[-1, 5\).*vocabulary"):
        s.upload(lab, np.array([0, 5, 1], np.int32))
