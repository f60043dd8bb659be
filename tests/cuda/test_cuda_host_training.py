"""The CUDA backend on the host device (toygraph/cuda/host/device.py) for what a training step
adds to the ops: block-format weights (dequantize, fused quantized matmul and get_rows,
per format and per matmul precision), AdamW with the global-norm clip, graph replay, and
the whole tiny-model LoRA step, against numpy with tests/cuda/test_cuda.py's tolerances.

Block formats come from blocks.BLOCK, so a new format is exercised here once it has
kernels (its row length is derived from its block size).
"""
import numpy as np
import pytest

from support.hostparity import MIXED_TOL, REDUCTION, qlinear, rel_err, rnd, run_phase
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.gguf import block_encode, blocks
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.core.optimizer import build_training, hp_row
from toygraph.core.session import Session

BLOCK_FORMATS = blocks.BLOCK_FORMATS


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def _cols(fmt):
    """A row length that leaves a partial 16-deep k tile (and, for f16/bf16, a partial
    64-wide n tile): two blocks plus what rounds 80 up to the block size."""
    qk = blocks.BLOCK[fmt][0]
    return 100 if qk == 1 else qk * (2 + -(-80 // qk))


def _session(g, precision="f32", inputs=None, phase="backward"):
    s = Session(g, backend="cuda", precision=precision)
    s.realize()
    s.reset()
    for t, v in (inputs or {}).items():
        s.upload(t, v)
    s.run(phase)
    return s


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantize_kernel_is_bit_exact(fmt):
    rng = np.random.default_rng(4)
    shape = (3, _cols(fmt))
    raw = block_encode.quantize(rnd(rng, *shape), fmt)
    g = Graph()
    y = g.output(ops.contiguous(g.const("w", raw, shape=shape, storage=fmt)))
    s = _session(g, phase="forward")
    np.testing.assert_array_equal(s.download(y), blocks.dequantize(raw, fmt, shape))


def _qlinear(fmt, rows=70, batch=(2, 33)):
    return qlinear(fmt, _cols(fmt), rows=rows, batch=batch)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_quantized_matmul_forward_and_backward(fmt, monkeypatch):
    """The fused kernels match numpy on the dequantized weight, and are bit-identical to
    dequantize + tg_matmul (TOYGRAPH_CUDA_QMATMUL=0)."""
    g, w, fetch, want = _qlinear(fmt)
    s = _session(g)
    got = [s.download(t) for t in fetch]
    assert s.backend.raw_consts == {w.id}, "W should stay in its block format"
    assert rel_err(got[0], want[0]) <= REDUCTION and rel_err(got[1], want[1]) <= REDUCTION
    monkeypatch.setenv("TOYGRAPH_CUDA_QMATMUL", "0")
    s0 = _session(g)
    assert not s0.backend.raw_consts
    assert all(np.array_equal(a, s0.download(t)) for a, t in zip(got, fetch))


@pytest.mark.parametrize("prec", ["bf16", "tf32"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_tensor_core_quantized_matmul(fmt, prec):
    g, w, fetch, want = _qlinear(fmt)
    s = _session(g, precision=prec)
    assert s.backend.raw_consts == {w.id}
    for t, ref in zip(fetch, want):
        assert rel_err(s.download(t), ref) <= MIXED_TOL[prec]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_quantized_get_rows_and_tied_head(fmt):
    rng = np.random.default_rng(2)
    rows, D = 37, _cols(fmt)
    raw = block_encode.quantize(rnd(rng, rows, D), fmt)
    g = Graph()
    table = g.const("table", raw, shape=(rows, D), storage=fmt)
    ids, x = g.input("ids", (3, 10), "i32"), g.input("x", (3, 10, 24))
    emb = g.output(ops.get_rows(table, ids))
    pv = rnd(rng, 24, D)
    logits = g.output(ops.matmul(x @ g.const("p", pv), table, trans_b=True))
    idv, xv = rng.integers(0, rows, size=(3, 10)).astype(np.int32), rnd(rng, 3, 10, 24)
    s = _session(g, inputs={ids: idv, x: xv})
    assert s.backend.raw_consts == {table.id}
    wv = blocks.dequantize(raw, fmt, (rows, D))
    np.testing.assert_array_equal(s.download(emb), wv[idv])
    want = (xv.astype(np.float64) @ pv.astype(np.float64)) @ wv.T.astype(np.float64)
    assert rel_err(s.download(logits), want) <= REDUCTION


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_linear_cross_entropy_with_a_block_format_head(fmt, monkeypatch):
    from toygraph.ops.loss import cuda as loss_ops
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * 300 * 32)
    rng = np.random.default_rng(1)
    N, D, V = 50, 256, 300
    g = Graph()
    h = g.param("h", rnd(rng, N, D))
    w = g.const("w", block_encode.quantize(rnd(rng, V, D), fmt), shape=(V, D), storage=fmt)
    lab = g.input("lab", (N,), "i32")
    loss = g.output(ops.linear_cross_entropy(h, w, lab))
    dh = accumulate_grads(backward(loss, [h]))[h]
    labv = np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)).astype(np.int32)
    cpu = run_phase(g, "cpu", {lab: labv}, "backward", [loss, dh])
    s = _session(g, inputs={lab: labv})
    assert w.id in s.backend.raw_consts
    for a, b in zip([s.download(loss), s.download(dh)], cpu):
        assert rel_err(a, b) <= REDUCTION


# --- AdamW, clip, replay ---------------------------------------------------------------------
def _mlp_train(backend, max_norm, steps=3, seed=0, n=24, d=16, h=40, v=30, lr_scale=1.0):
    """A two-layer MLP trained ``steps`` AdamW steps (sum loss, count division, clip);
    ``lr_scale`` multiplies the second layer's learning rate (LoRA+'s per-tensor rate)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x, lab = g.input("x", (n, d)), g.input("lab", (n,), "i32")
    w1, b1 = g.param("w1", rnd(rng, d, h, s=0.3)), g.param("b1", rnd(rng, h, s=0.1))
    w2, b2 = g.param("w2", rnd(rng, h, v, s=0.3)), g.param("b2", rnd(rng, v, s=0.1))
    hid = ops.rms_norm(ops.silu(x @ w1 + b1), 1e-5)
    loss = g.output(ops.cross_entropy(hid @ w2 + b2, lab, reduction="sum"))
    step = build_training(loss, [w1, b1, w2, b2], count=ops.count_valid(lab), max_norm=max_norm,
                          lr_scales={w2: lr_scale, b2: lr_scale})
    s = Session(g, backend=backend)
    s.realize()
    losses = []
    for t in range(1, steps + 1):
        s.reset() if t == 1 else s.reset_grads()
        s.upload(x, rnd(rng, n, d))
        s.upload(lab, rng.integers(-1, v, size=n).astype(np.int32))
        s.upload(step.hp, hp_row(t, lr=1e-2, weight_decay=0.01))
        s.run("step")
        losses.append(float(s.download(loss)))
    return losses, [s.download(p) for p in step.grads], float(s.download(step.grad_norm))


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_adamw_step_with_clip_matches_numpy_and_replays_identically(max_norm, monkeypatch):
    """Losses, weights and the global norm after 3 AdamW steps (the 0.05 clip binds) within
    1e-4 of numpy; bit-identical run to run and with graph replay off."""
    cpu = _mlp_train("cpu", max_norm)
    got = _mlp_train("cuda", max_norm)
    for a, b in zip(got[0], cpu[0]):
        assert abs(a - b) <= 1e-4 * abs(b)
    for a, b in zip(got[1], cpu[1]):
        assert rel_err(a, b) <= 1e-4
    assert abs(got[2] - cpu[2]) <= 1e-4 * cpu[2]
    assert max_norm == 0 or got[2] > 10 * max_norm   # the clip really scales the step
    again = _mlp_train("cuda", max_norm)
    monkeypatch.setenv("TOYGRAPH_CUDA_GRAPHS", "0")
    eager = _mlp_train("cuda", max_norm)
    for other in (again, eager):
        assert other[0] == got[0] and other[2] == got[2]
        assert all(np.array_equal(a, b) for a, b in zip(other[1], got[1]))


def test_adamw_per_tensor_lr_scale_matches_numpy():
    """LoRA+'s learning-rate multiplier (a kernel argument) as numpy applies it, and it
    changes the trained weights (a scale the kernel ignored would not)."""
    cpu, got = _mlp_train("cpu", 0.0, lr_scale=8.0), _mlp_train("cuda", 0.0, lr_scale=8.0)
    for a, b in zip(got[0], cpu[0]):
        assert abs(a - b) <= 1e-4 * abs(b)
    for a, b in zip(got[1], cpu[1]):
        assert rel_err(a, b) <= 1e-4
    plain = _mlp_train("cuda", 0.0)
    assert abs(plain[0][-1] - got[0][-1]) > 1e-3 * abs(got[0][-1])


def test_adamw_step_with_capped_grids_matches_numpy(monkeypatch):
    """The step with every grid capped at 3 blocks (2 partial sums per gradient norm), so
    AdamW, the norm, cross-entropy and the row kernels loop over what the grid misses."""
    from toygraph.ops.lowering import launch
    from toygraph.ops.update import cuda as optim_ops
    monkeypatch.setattr(launch, "MAX_GRID", 3)
    monkeypatch.setattr(optim_ops, "SUMSQ_BLOCKS", 2)
    cpu, got = _mlp_train("cpu", 0.05, n=70, h=300), _mlp_train("cuda", 0.05, n=70, h=300)
    for a, b in zip(got[0], cpu[0]):
        assert abs(a - b) <= 1e-4 * abs(b)
    for a, b in zip(got[1], cpu[1]):
        assert rel_err(a, b) <= 1e-4
    assert abs(got[2] - cpu[2]) <= 1e-4 * cpu[2]


@pytest.mark.parametrize("case", ["attention", "tc_matmul_bf16", "lce_chunks", "mlp_step"])
def test_results_do_not_depend_on_the_thread_schedule(case, monkeypatch):
    """Threads of a block run first to last between barriers, then last to first
    (TOYGRAPH_HOST_SCHEDULE=reverse): a read of shared memory another thread writes without
    a barrier in between sees a different value, so race-free kernels are bit-identical."""
    from support.hostparity import op_case
    from toygraph.ops.loss import cuda as loss_ops
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * 300 * 24)

    def run():
        if case == "mlp_step":
            losses, params, norm = _mlp_train("cuda", 0.05)
            return [np.array(losses), np.array(norm)] + params
        if case == "lce_chunks":
            def build(h, w, lab):
                return ops.linear_cross_entropy(h, w, lab).reshape(1)

            def inputs_fn(g, rng):
                return {g.input("lab", (70,), "i32"): rng.integers(-1, 300, 70).astype(np.int32)}
            g, extra, fetch = op_case(build, [(70, 40), (300, 40)], inputs_fn)
        elif case == "attention":
            g, extra, fetch = op_case(
                lambda q, k, v: ops.attention(q, k, v, scale=0.25, causal=True),
                [(1, 4, 37, 16), (1, 2, 37, 16), (1, 2, 37, 16)])
        else:
            g, extra, fetch = op_case(lambda a, b: ops.matmul(a, b), [(130, 70), (70, 90)])
        return run_phase(g, "cuda", extra, "backward", fetch,
                         "bf16" if case == "tc_matmul_bf16" else "f32")

    forward = run()
    monkeypatch.setenv("TOYGRAPH_HOST_SCHEDULE", "reverse")
    reverse = run()
    assert all(np.array_equal(a, b) for a, b in zip(forward, reverse))


# --- the whole LoRA step of a tiny model ------------------------------------------------------
def _lora_run(path, backend, steps=3, precision="f32",
              targets=("q", "k", "v", "o", "gate", "up", "down")):
    """A LoRA recipe on ``path`` trained ``steps`` steps; the recipe's session is driven
    directly (inputs, hp, run "step", loss sum / count), which keeps this test apart from
    how Recipe.step shapes its arguments."""
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    model = GGUFModel(path)
    B, T = 2, 16
    recipe = LoRA(targets=targets, rank=4, alpha=8)
    recipe.realize(model, model.config, RecipeOptions(seq_len=T, batch=B, seed=3,
                                                      init_scale=0.05, backend=backend,
                                                      precision=precision))
    s, rng = recipe.sess, np.random.default_rng(0)
    losses = []
    for i in range(steps):
        ids = rng.integers(0, model.config.n_vocab, size=(B, T)).astype(np.int32)
        lab = np.roll(ids, -1, axis=1).astype(np.int32)
        lab[:, -1] = -1
        s.reset() if i == 0 else s.reset_grads()
        s.upload(recipe.train.hp, hp_row(i + 1, lr=1e-2))
        s.upload(recipe.net.tokens, ids)
        s.upload(recipe.net.positions, np.tile(np.arange(T, dtype=np.int32), (B, 1)))
        s.upload(recipe.labels, lab.reshape(-1))
        s.run("step")
        losses.append(float(s.download(recipe.loss_sum)) / float(s.download(recipe.count)))
    return recipe, losses


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_llama_kquant"])
def test_lora_step_of_a_tiny_model_matches_numpy(model, request):
    """The recipe's whole step (fused head + loss, attention, block-format weights read in
    place, AdamW) on the host device: every loss within 1e-4 of numpy, deterministic."""
    path = request.getfixturevalue(model)
    _, cpu_losses = _lora_run(path, "cpu")
    recipe, losses = _lora_run(path, "cuda")
    quantized = [t for t in recipe.graph.by_role("const") if t.storage != "f32"]
    assert quantized and {t.id for t in quantized} <= recipe.sess.backend.raw_consts
    for a, b in zip(losses, cpu_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, cpu_losses)
    assert _lora_run(path, "cuda")[1] == losses


@pytest.mark.parametrize("name,fmt", [("qwen3moe", "q8_0"), ("gpt-oss", "mxfp4")])
def test_lora_step_of_a_mixture_of_experts_matches_numpy(name, fmt, tmp_path):
    """The MoE fixtures (tests/support/files/moe) with their experts in a block format: the grouped
    GEMMs read them in it on the device; 3 attention-LoRA steps within 1e-4 of numpy
    (gpt-oss: sinks, biases, clamped SwiGLU and YaRN on the host device too)."""
    from support.moe_references import requantize
    path = requantize(name, tmp_path / f"{fmt}.gguf", {"_exps.weight": fmt})
    attention = ("q", "k", "v", "o")
    _, cpu_losses = _lora_run(path, "cpu", targets=attention)
    recipe, losses = _lora_run(path, "cuda", targets=attention)
    experts = [t for t in recipe.graph.by_role("const") if "_exps.weight" in t.name]
    assert experts and all(t.storage == fmt for t in experts if t.name.endswith(".weight"))
    assert {t.id for t in experts} <= recipe.sess.backend.raw_consts
    for a, b in zip(losses, cpu_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, cpu_losses)


@pytest.mark.parametrize("prec", ["bf16", "tf32"])
def test_lora_step_in_mixed_precision_tracks_f32(prec, tiny_llama):
    _, f32_losses = _lora_run(tiny_llama, "cuda")
    _, losses = _lora_run(tiny_llama, "cuda", precision=prec)
    for a, b in zip(losses, f32_losses):
        assert abs(a - b) <= 2e-2 * abs(b), (losses, f32_losses)
    assert losses != f32_losses   # the emulated tensor cores really ran
