"""core/frozen_base.py and the numpy backend's frozen base in blocks: with the CPU engine the
products on the blocks agree with the f32-decoded base's within f32 rounding (every block
type, forward, dx through the weight; get_rows bit for bit; LoRA steps' losses); without
it (the scratch path) the results are the decoded base's bit for bit; the plan reports
what it holds, ``auto`` keeps the blocks with the engine and chooses by memory without
it, and a plan that cannot fit is refused in one line."""
import numpy as np
import pytest

from toygraph import ops
from toygraph.core import frozen_base
from toygraph.core.graph import Graph, topo_order
from toygraph.core.buffer_plan import aligned, plan_buffers
from toygraph.core.optimizer import hp_row
from toygraph.core.session import Session
from toygraph.errors import GraphError, SettingError
from toygraph.fixtures import tiny_models
from toygraph.cpu import block_tensor, engine
from toygraph.gguf import block_encode, blocks
from toygraph.models.model import GGUFModel
from toygraph.recipes import RECIPES, RecipeOptions

ROWS, COLS, N = 48, 256, 5


def _weight_graph(qtype: str):
    """x @ W^T, dy @ W (the backward's dx) and W's rows, for a const W stored as qtype."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    g = Graph()
    wt = g.const("w", block_encode.quantize(w, qtype), shape=(ROWS, COLS), storage=qtype)
    x, dy = g.input("x", (N, COLS)), g.input("dy", (N, ROWS))
    ids = g.input("ids", (2, 3), "i32")
    outs = [g.output(ops.matmul(x, wt, trans_b=True)), g.output(ops.matmul(dy, wt)),
            g.output(ops.get_rows(wt, ids))]
    feed = {x: rng.standard_normal((N, COLS)), dy: rng.standard_normal((N, ROWS)),
            ids: np.array([[0, 47, 3], [3, 3, 12]], np.int32)}
    return g, wt, outs, feed


def _run(g, outs, feed, mode, dtype="f32"):
    sess = Session(g, base_memory=mode, dtype=dtype)
    sess.realize()
    for t, v in feed.items():
        sess.upload(t, v)
    sess.run("forward")
    return sess, [sess.download(t) for t in outs]


@pytest.fixture
def no_engine(monkeypatch):
    """The scratch path: every block-format read decoded whole first, as without a compiler."""
    monkeypatch.setattr(engine, "available", lambda fmt=None: False)


def _within_product_bound(got, want, a, w):
    """|got - want| <= 2 k u (|a| |w|) elementwise (k the summed length, u = 2^-24): two
    f32 sums of the same products in different orders, each within k u of the exact one."""
    bound = 2 * a.shape[-1] * 2.0 ** -24 * (np.abs(a) @ np.abs(w))
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound + 1e-30)


@pytest.mark.parametrize("qtype", engine.FORMATS)
def test_every_block_type_agrees_with_the_decoded_base(qtype):
    g, w, outs, feed = _weight_graph(qtype)
    ref_sess, ref = _run(g, outs, feed, "decode")
    sess, got = _run(g, outs, feed, "quantized")
    wd = blocks.dequantize(w.data, qtype, w.shape).astype(np.float64)
    x, dy = (np.asarray(v, np.float32).astype(np.float64) for v in list(feed.values())[:2])
    _within_product_bound(got[0], x @ wd.T, x, wd.T)
    _within_product_bound(got[1], dy @ wd, dy, wd)
    _within_product_bound(ref[0], x @ wd.T, x, wd.T)
    np.testing.assert_array_equal(got[2].view(np.uint32), ref[2].view(np.uint32))   # get_rows
    assert ref_sess.plan.base_memory == "decode" and not ref_sess.plan.quantized
    plan = sess.plan
    assert plan.base_memory == "quantized" and plan.quantized == {w.id}
    assert plan.base_bytes == blocks.nbytes(qtype, (ROWS, COLS))
    assert plan.scratch_bytes == 0   # the engine multiplies on the blocks, get_rows decodes rows
    assert plan.pinned_bytes == ref_sess.plan.pinned_bytes - 4 * ROWS * COLS
    np.testing.assert_array_equal(sess.download(w), blocks.dequantize(w.data, qtype, w.shape))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "iq4_xs", "bf16"])
def test_without_the_engine_every_block_type_gives_the_decoded_results_bit_for_bit(qtype, no_engine):
    g, w, outs, feed = _weight_graph(qtype)
    ref = _run(g, outs, feed, "decode")[1]
    sess, got = _run(g, outs, feed, "quantized")
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert sess.plan.scratch_bytes == aligned(4 * ROWS * COLS)   # get_rows needs none


def test_f64_buffers_decode_too():
    g, _, outs, feed = _weight_graph("q4_k")
    ref = _run(g, outs, feed, "decode", dtype="f64")[1]
    got = _run(g, outs, feed, "quantized", dtype="f64")[1]
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


def test_kernels_read_the_scratch_read_only(monkeypatch, no_engine):
    from toygraph.ops import KERNELS
    seen = []
    plain = KERNELS["matmul"]

    def spy(out, srcs, attrs):
        seen.append(srcs[1].flags.writeable)
        plain(out, srcs, attrs)

    monkeypatch.setitem(KERNELS, "matmul", spy)
    g, _, outs, feed = _weight_graph("q8_0")
    _run(g, outs, feed, "quantized")
    assert seen == [False, False]


# --- whole training steps ------------------------------------------------------------------
MODELS = {
    "mixed": lambda p: tiny_models.write_tiny_llama(p, n_layer=2),   # q8_0 q4_0 q4_1 f16 bf16
    "k_quants": lambda p: tiny_models.write_tiny_llama(p, n_layer=2, n_embd=256, n_ff=512,
                                                       weight_types=tiny_models.K_QUANT_TYPES),
    "iq4_q5": lambda p: tiny_models.write_tiny_llama(
        p, n_layer=1, n_embd=256, n_ff=512, tied=False,
        weight_types={"token_embd": "iq4_nl", "output": "iq4_xs", "attn_q": "q5_0",
                      "attn_k": "q5_1", "attn_v": "q2_k", "attn_output": "q3_k",
                      "ffn_gate": "iq4_nl", "ffn_up": "iq4_xs", "ffn_down": "q5_0"}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("frozen_base")
    return {name: write(d / f"{name}.gguf") for name, write in MODELS.items()}


def _steps(path, mode, monkeypatch, checkpoint=False, steps=2,
           targets=("q", "k", "v", "o", "gate", "up", "down")):
    monkeypatch.setenv("TOYGRAPH_BASE_MEMORY", mode)
    model = GGUFModel(path)
    recipe = RECIPES["lora"](targets=targets)
    recipe.realize(model, model.config, RecipeOptions(seq_len=16, batch=2, seed=3,
                                                      checkpoint_activations=checkpoint))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.n_vocab, (steps, 1, 2, 16)).astype(np.int32)
    labels = rng.integers(-1, model.config.n_vocab, (steps, 1, 2, 16)).astype(np.int32)
    pos = np.tile(np.arange(16, dtype=np.int32), (1, 2, 1))
    losses = [recipe.step(tokens[i], pos, labels[i], hp_row(i + 1, 1e-2), is_first=i == 0)
              for i in range(steps)]
    return recipe, losses


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_lora_steps_agree_with_the_base_quantized(models, name, checkpoint, monkeypatch):
    """The engine's products on the blocks sum in their own order: two LoRA steps' losses
    within 1e-5 relative of the decoded base's (measured: a few 1e-7)."""
    ref, ref_losses = _steps(models[name], "decode", monkeypatch, checkpoint)
    got, losses = _steps(models[name], "quantized", monkeypatch, checkpoint)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    plan = got.sess.plan
    assert plan.base_memory == "quantized" and "base kept quantized" in plan.summary()
    assert plan.scratch_bytes == 0 and got.sess.backend.decode_seconds == 0
    assert ref.sess.plan.total_bytes > plan.total_bytes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_without_the_engine_lora_steps_are_bit_identical(models, name, monkeypatch, no_engine):
    ref, ref_losses = _steps(models[name], "decode", monkeypatch, checkpoint=True)
    got, losses = _steps(models[name], "quantized", monkeypatch, checkpoint=True)
    assert [x.hex() for x in losses] == [x.hex() for x in ref_losses]
    after, want = got.trainable(), ref.trainable()
    for key in want:
        np.testing.assert_array_equal(after[key], want[key], err_msg=key)
    assert got.sess.backend.decode_seconds > 0


@pytest.mark.parametrize("with_engine", [True, False])
@pytest.mark.parametrize("name,qtype", [("qwen3moe", "q8_0"), ("gpt-oss", "mxfp4")])
def test_moe_lora_steps_with_the_experts_quantized(name, qtype, with_engine, tmp_path,
                                                   monkeypatch):
    """The committed MoE fixtures with their experts (and attention) requantized: LoRA
    steps read only the chosen experts' blocks and give decode mode's losses, bit for bit
    on the scratch path, within f32 rounding through the engine."""
    from support.moe_references import requantize
    if not with_engine:
        monkeypatch.setattr(engine, "available", lambda fmt=None: False)
    path = requantize(name, tmp_path / "m.gguf", {"_exps": qtype, "attn_q.": "q8_0"})
    ref, ref_losses = _steps(path, "decode", monkeypatch, targets=("q", "k", "v", "o"))
    got, losses = _steps(path, "quantized", monkeypatch, targets=("q", "k", "v", "o"))
    if with_engine:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    else:
        assert [x.hex() for x in losses] == [x.hex() for x in ref_losses]
        after, want = got.trainable(), ref.trainable()
        for key in want:
            np.testing.assert_array_equal(after[key], want[key], err_msg=key)
    exps = [t for t in got.graph.nodes if t.id in got.sess.plan.quantized and "_exps" in t.name]
    assert exps and all(t.storage == qtype for t in exps)


def test_the_tied_head_is_decoded_once_per_step(models, monkeypatch, no_engine):
    """Forward logits and backward dh read the head back to back: the scratch still holds
    it, so the tied embedding is decoded once (get_rows reads only its rows). Every other
    matrix is decoded twice (forward and dx), but layer 0's q/k/v: nothing below them
    trains, so no dx flows through them."""
    counts: dict[str, int] = {}
    plain = block_tensor.BlockTensor.decode_into
    names = {}

    def counting(self, out):
        counts[names[id(self)]] = counts.get(names[id(self)], 0) + 1
        return plain(self, out)

    recipe, _ = _steps(models["mixed"], "quantized", monkeypatch, steps=1)
    backend = recipe.sess.backend
    for t in recipe.graph.nodes:
        if t.id in recipe.sess.plan.quantized:
            names[id(backend.arrays[t.id])] = t.name
    monkeypatch.setattr(block_tensor.BlockTensor, "decode_into", counting)
    recipe.step(*_one_batch(recipe), hp_row(2, 1e-2), is_first=False)
    assert counts.pop("token_embd.weight") == 1
    once = {f"blk.0.attn_{x}.weight" for x in "qkv"}
    assert {k for k, n in counts.items() if n == 1} == once
    assert {n for k, n in counts.items() if k not in once} == {2} and len(counts) == 2 * 7


def _one_batch(recipe):
    rng = np.random.default_rng(1)
    vocab = recipe.model_cfg.n_vocab
    tokens = rng.integers(0, vocab, (1, 2, 16)).astype(np.int32)
    return tokens, np.tile(np.arange(16, dtype=np.int32), (1, 2, 1)), tokens


# --- the choice and the fit check ------------------------------------------------------------
def _planned(mode, available):
    """The weight graph's plan, as if its other pinned tensors took 9 times the weight's
    f32 bytes (so keeping the weight quantized makes the plan smaller)."""
    g, _, outs, _ = _weight_graph("q8_0")
    order = topo_order(outs)
    pinned = {t.id for t in order if t.role is not None} | {t.id for t in outs}
    plan = plan_buffers(order, pinned, 4, pinned_bytes=10 * 4 * ROWS * COLS)
    return frozen_base.plan_base(order, plan, pinned, (), mode, 4, available=available)


def test_auto_keeps_the_blocks_for_the_engine():
    assert engine.available()
    plan = _planned("auto", available=1 << 40)
    assert plan.base_memory == "quantized" and plan.scratch_bytes == 0


def test_without_the_engine_auto_decodes_when_the_decoded_plan_fits_and_keeps_blocks_when_not(
        no_engine):
    roomy = _planned("auto", available=1 << 40)
    assert roomy.base_memory == "decode" and roomy.scratch_bytes == 0
    tight = _planned("auto", available=10 * 4 * ROWS * COLS)
    assert tight.base_memory == "quantized" and tight.scratch_bytes > 0
    assert _planned("decode", available=1).base_memory == "decode"   # forced


def test_a_plan_that_cannot_fit_is_refused_in_one_line_before_allocating(monkeypatch):
    g, _, outs, feed = _weight_graph("q8_0")
    monkeypatch.setattr(frozen_base, "available_bytes", lambda: 1000)
    sess = Session(g, base_memory="decode")
    with pytest.raises(GraphError) as err:
        sess.realize()
    msg = str(err.value)
    assert "\n" not in msg and "GiB available" in msg and "TOYGRAPH_BASE_MEMORY=quantized" in msg
    assert not sess.backend.arrays   # nothing was allocated


def test_bad_modes_are_named(monkeypatch):
    g = _weight_graph("q8_0")[0]
    with pytest.raises(GraphError, match="base_memory must be one of auto, decode, quantized"):
        Session(g, base_memory="f32")
    monkeypatch.setenv("TOYGRAPH_BASE_MEMORY", "lazy")
    with pytest.raises(SettingError, match="TOYGRAPH_BASE_MEMORY"):
        Session(g)


def test_f32_files_and_graphs_without_block_consts_report_no_base():
    g = Graph()
    w = g.const("w", np.ones((4, 4), np.float32))
    x = g.input("x", (2, 4))
    g.output(ops.matmul(x, w, trans_b=True))
    sess = Session(g, base_memory="quantized")
    plan = sess.realize()
    assert plan.base_memory == "" and "base" not in plan.summary()


@pytest.mark.parametrize("qtype", ["q8_0", "q6_k"])
def test_the_fused_head_reads_a_head_kept_in_blocks_through_the_engine(qtype):
    """linear_cross_entropy and its backward (dh) over a frozen head in blocks: the engine
    multiplies each chunk of rows on the blocks (no decode scratch), agreeing with the
    decoded head's BLAS products to f32 rounding."""
    rng = np.random.default_rng(4)
    V, D, N = 300, 256, 150            # more rows than one chunk (LCE_ROWS = 128)
    g = Graph()
    head = g.const("head", block_encode.quantize((rng.standard_normal((V, D)) * 0.1)
                                                 .astype(np.float32), qtype),
                   shape=(V, D), storage=qtype)
    h = g.param("h", (rng.standard_normal((N, D)) * 0.5).astype(np.float32))
    labels = g.input("labels", (N,), "i32")
    loss = ops.linear_cross_entropy(h, head, labels, reduction="sum")
    from toygraph.core.autodiff import backward
    grads = backward(loss, [h])
    outs = [g.output(loss), g.output(grads[h])]
    feed = {labels: np.where(rng.random(N) < 0.2, -1, rng.integers(0, V, N)).astype(np.int32)}
    ref = _run(g, outs, feed, "decode")[1]
    sess, got = _run(g, outs, feed, "quantized")
    assert sess.plan.scratch_bytes == 0 and sess.backend.decode_seconds == 0
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-6 * np.abs(ref[1]).max())


def test_the_cpu_fuses_the_head_where_the_logits_would_be_large():
    from toygraph.recipes import base as recipe_base

    class Cfg:
        logit_softcap, n_vocab = 0.0, 151936
    assert not recipe_base.fused_head("cpu", Cfg(), rows=128)        # 156 MB of logits + grads
    assert recipe_base.fused_head("cpu", Cfg(), rows=512)            # 622 MB
    assert recipe_base.fused_head("cuda", Cfg(), rows=1)
    # few slots labelled (chat data): the fused head skips the rest, so the CPU fuses it
    assert recipe_base.fused_head("cpu", Cfg(), rows=128, labelled_share=0.25)
    assert not recipe_base.fused_head("cpu", Cfg(), rows=128, labelled_share=0.9)
    Cfg.logit_softcap = 30.0
    assert not recipe_base.fused_head("cpu", Cfg(), rows=4096)
