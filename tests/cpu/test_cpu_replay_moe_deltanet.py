"""The CPU engine's replay kernels of the experts family (the router's topk, take_along,
put_along, group_by_expert, expert_matmul in f32 and on GGUF blocks, expert_matmul_dw) and
of the deltanet family (causal_conv1d, delta_rule and their backwards) against their
numpy kernels, at ragged shapes; then LoRA steps of the tiny MoE models and of a tiny
Qwen3.5 replayed in the engine against the numpy backend.

The bound is test_cpu_replay.py's (``check_op``: within 4x numpy's own f32 error of the
op's numpy kernel run in f64, plus 2^-18 of the result's scale); integer results (topk's
ids, the routes) and pure data movement (take_along, put_along, the conv's sums in numpy's
order) are numpy's bits. Every result is the same bits at 1, 2 and 3 threads.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from test_cpu_replay import _broken, as64, check_bits_across_threads, check_op, rand, run_engine
from test_cpu_replay import lib  # noqa: F401  (autouse: the engine, or the module skips)
from toygraph.cpu import engine
from toygraph.cpu.block_tensor import BlockTensor
from toygraph.cpu.replay import REPLAYS
from toygraph.errors import ToygraphError
from toygraph.gguf import block_encode
from toygraph.ops import BLOCK_KERNELS, KERNELS
import toygraph.ops.replays  # noqa: F401

SLACK = 2.0 ** -18


def numpy_result(op, shape, srcs, attrs, dtype=np.float32):
    out = np.zeros(shape, dtype)
    KERNELS[op](out, [np.copy(s) for s in srcs], attrs)
    return out


def engine_result(op, shape, srcs, attrs, dtype=np.float32, lib=None):
    fill = np.nan if dtype == np.float32 else -7
    return run_engine(op, np.full(shape, fill, dtype), [np.copy(s) for s in srcs], attrs, lib)


# --- the router --------------------------------------------------------------------------------
def _scores(*shape, seed=0):
    """Scores with many ties (multiples of 1/4), and NaN, +-inf and -0.0 among them."""
    x = np.round(rand(*shape, seed=seed) * 4) / 4
    flat = x.reshape(-1)
    flat[3::17], flat[5::23], flat[7::29], flat[11::31] = np.nan, np.inf, -np.inf, -0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("shape,k", [((37, 7), 1), ((37, 7), 3), ((37, 7), 7), ((2, 5, 9), 2),
                                     ((3, 128), 8)])
def test_topk_is_numpys_stable_order(shape, k):
    x = _scores(*shape)
    want = numpy_result("topk", shape[:-1] + (k,), [x], {"k": k}, np.int32)
    assert np.array_equal(engine_result("topk", want.shape, [x], {"k": k}, np.int32), want)


def _ids(N, k, E, used=None, seed=0):
    """[N, k] distinct experts per row, drawn from ``used`` (default all E)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(E) if used is None else np.asarray(used)
    return np.stack([rng.choice(pool, k, replace=False) for _ in range(N)]).astype(np.int32)


@pytest.mark.parametrize("lead,E,k", [((37,), 7, 3), ((2, 5), 9, 2), ((1,), 4, 4)])
def test_take_along_and_put_along_are_numpys_bits(lead, E, k):
    x = rand(*lead, E)
    ids = _ids(int(np.prod(lead)), k, E).reshape(*lead, k)
    shape = tuple(lead) + (k,)
    assert np.array_equal(engine_result("take_along", shape, [x, ids], {}),
                          numpy_result("take_along", shape, [x, ids], {}))
    g = rand(*shape, seed=1)
    repeats = np.random.default_rng(2).integers(0, E, shape).astype(np.int32)  # np.add.at sums
    for i in (ids, repeats):
        want = numpy_result("put_along", tuple(lead) + (E,), [g, i], {"width": E})
        assert np.array_equal(engine_result("put_along", want.shape, [g, i], {"width": E}), want)
    check_op("take_along", shape, [x, ids], {})


def _routes(ids, E):
    return numpy_result("group_by_expert", (E + 1 + ids.size,), [ids], {"n_expert": E}, np.int32)


@pytest.mark.parametrize("N,k,E,used", [(37, 2, 9, [0, 2, 3, 7]), (1, 1, 4, None), (23, 3, 5, None),
                                        (2101, 2, 60, None)])
def test_group_by_expert_is_numpys_stable_order(N, k, E, used):
    """Experts no slot chose (empty groups), one slot, and more slots than one task takes
    (4202: the counts are made per task and placed in order)."""
    ids = _ids(N, k, E, used)
    want = _routes(ids, E)
    assert np.array_equal(engine_result("group_by_expert", want.shape, [ids], {"n_expert": E},
                                        np.int32), want)


def test_ids_out_of_range_fail_the_node():
    ids = np.array([[0, 5]], np.int32)
    with pytest.raises(ToygraphError, match=r"group_by_expert\) failed \(code -3\)"):
        engine_result("group_by_expert", (4 + 1 + 2,), [ids], {"n_expert": 4}, np.int32)
    with pytest.raises(ToygraphError, match=r"take_along\) failed \(code -3\)"):
        engine_result("take_along", (1, 2), [rand(1, 4), ids], {})


# --- the expert products -----------------------------------------------------------------------
def _product_operands(N, k, E, n_in, n_out, trans_b, per_slot, used, seed=0):
    ids = _ids(N, k, E, used, seed)
    x = rand(N, k, n_in, seed=seed + 1) if per_slot else rand(N, n_in, seed=seed + 1)
    w = rand(E, n_out, n_in, seed=seed + 2) if trans_b else rand(E, n_in, n_out, seed=seed + 2)
    return x, w, _routes(ids, E)


PRODUCTS = {
    # name: (N, k, E, n_in, n_out, experts some slot chose)
    "ragged": (37, 3, 9, 70, 45, [0, 1, 4, 5, 8]),
    "one-slot": (13, 1, 5, 33, 7, None),
    # most slots with expert 0: its group is several runs of rows; K past one run of 256
    "long-group": (150, 2, 3, 300, 40, [0, 1]),
}


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("case", sorted(PRODUCTS))
def test_expert_matmul(case, trans_b, per_slot):
    N, k, E, n_in, n_out, used = PRODUCTS[case]
    x, w, routes = _product_operands(N, k, E, n_in, n_out, trans_b, per_slot, used)
    check_op("expert_matmul", (N, k, n_out), [x, w, routes], {"trans_b": trans_b})


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("case", sorted(PRODUCTS) + ["lora-a", "lora-b"])
def test_expert_matmul_dw(case, trans_b, per_slot):
    """dW of every expert (zero for the unchosen), and the LoRA shapes: A's [E, r, n_in]
    and B's narrow [E, n_out, r] (computed transposed)."""
    N, k, E, n_in, n_out, used = {"lora-a": (29, 2, 6, 64, 4, [1, 2, 5]),
                                  "lora-b": (29, 2, 6, 4, 96, None)}.get(case) or PRODUCTS[case]
    x, w, routes = _product_operands(N, k, E, n_in, n_out, trans_b, per_slot, used)
    g = rand(N, k, n_out, seed=7)
    got = check_op("expert_matmul_dw", w.shape, [g, x, routes],
                   {"trans_b": trans_b, "w_shape": w.shape})
    if used is not None:
        assert not got[[e for e in range(E) if e not in used]].any()


def _expert_blocks(fmt, shape, seed=0):
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32)
    return BlockTensor(block_encode.quantize(w.reshape(-1, shape[-1]), fmt), fmt, shape)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("per_slot", [False, True])
def test_expert_matmul_on_blocks(fmt, trans_b, per_slot):
    """The experts in their blocks, multiplied on them: against the numpy block kernel
    (which decodes each chosen expert) by test_cpu_replay's bound, its f64 reference the
    product with the decoded experts in f64. 2 of 7 experts unchosen; 2 rows of expert 6
    (the f32 row-dot kernels), more for the others (the panels)."""
    N, k, E = 23, 2, 7
    n_in, n_out = (256, 48) if trans_b else (48, 256)   # rows of whole blocks
    shape = (E, n_out, n_in) if trans_b else (E, n_in, n_out)
    w = _expert_blocks(fmt, shape)
    ids = _ids(N, k, E, [0, 2, 3, 5])
    ids[:2, 1] = 6
    routes = _routes(ids, E)
    x = rand(N, k, n_in, seed=3) if per_slot else rand(N, n_in, seed=3)
    attrs = {"trans_b": trans_b}
    ref = np.zeros((N, k, n_out))
    KERNELS["expert_matmul"](ref, [as64(x), as64(np.asarray(w)), routes], attrs)
    f32 = np.zeros((N, k, n_out), np.float32)
    BLOCK_KERNELS["expert_matmul"][0](f32, [x, w, routes], attrs,
                                      np.zeros(int(np.prod(shape[1:])), np.float32))
    got = engine_result("expert_matmul", (N, k, n_out), [x, w, routes], attrs)
    bound = 4 * np.abs(f32 - ref) + SLACK * np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= bound)


UNREAD = """
import ctypes, mmap, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_cpu_replay_moe_deltanet import _expert_blocks, _ids, _routes, run_engine
# 6 experts of [64, 1024] in q8_0: 69,632 bytes each, 17 pages: page-aligned in an mmap
w = _expert_blocks("q8_0", (6, 64, 1024))
area = mmap.mmap(-1, w.nbytes)
raw = np.frombuffer(area, np.uint8)
raw[:] = w.data
w = type(w)(raw, "q8_0", w.shape)
per = w.nbytes // 6
mprotect = ctypes.CDLL(None, use_errno=True).mprotect
mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
for e in (1, 4):   # no slot chooses them: a read of their pages faults
    assert mprotect(raw.ctypes.data + e * per, per, 0) == 0
ids = _ids(9, 2, 6, [0, 2, 3, 5])
x = np.ones((9, 1024), np.float32)
if sys.argv[1] == "engine":
    y = run_engine("expert_matmul", np.full((9, 2, 64), np.nan, np.float32),
                   [x, w, _routes(ids, 6)], {{"trans_b": True}})
else:   # the control: decoding the whole tensor reads every expert
    y = np.asarray(w)
print("done", np.isfinite(y).all())
"""


def test_experts_no_slot_chose_are_never_read():
    """Their pages made unreadable (mprotect PROT_NONE), in a child process: the engine's
    product on the blocks completes, where a decode of the whole tensor (the control)
    ends the child with SIGSEGV."""
    code = textwrap.dedent(UNREAD).format(tests=str(Path(__file__).parent))

    def child(what):
        return subprocess.run([sys.executable, "-c", code, what], capture_output=True, text=True,
                              timeout=120)
    ran = child("engine")
    assert ran.returncode == 0 and "done True" in ran.stdout, ran.stderr[-2000:]
    assert child("decode").returncode == -11


def test_expert_refusals_keep_the_numpy_kernel():
    x, w, routes = _product_operands(9, 2, 4, 16, 8, True, False, None)
    out = np.zeros((9, 2, 8), np.float32)
    attrs = {"trans_b": True}
    assert REPLAYS["expert_matmul"](None, out, [rand(9, 32)[:, :16], w, routes], attrs) is None
    assert REPLAYS["expert_matmul"](None, out, [x, w.astype(np.float64), routes], attrs) is None
    assert REPLAYS["expert_matmul"](None, out, [x, w, routes.astype(np.int64)], attrs) is None
    assert REPLAYS["topk"](None, np.zeros((9, 2), np.int64), [x], {"k": 2}) is None


# --- causal conv1d -----------------------------------------------------------------------------
CONVS = [(2, 9, 13, 4), (1, 2, 5, 4), (3, 17, 70, 1), (1, 40, 130, 3)]   # B, T, C, K


@pytest.mark.parametrize("B,T,C,K", CONVS)
def test_causal_conv1d(B, T, C, K):
    """The forward and dx are numpy's bits (the same products added in the same order);
    dw (numpy's sum over (b, t) in its own order) within the bound."""
    x, w, g = rand(B, T, C), rand(C, K, seed=1), rand(B, T, C, seed=2)
    assert np.array_equal(engine_result("causal_conv1d", x.shape, [x, w], {}),
                          numpy_result("causal_conv1d", x.shape, [x, w], {}))
    got = check_op("causal_conv1d_back", (x.size + w.size,), [x, w, g], {})
    want = numpy_result("causal_conv1d_back", (x.size + w.size,), [x, w, g], {})
    assert np.array_equal(got[:x.size], want[:x.size])


# --- the gated delta rule ----------------------------------------------------------------------
def delta_inputs(B, T, H, dk, dv, seed=0, decay=0.3):
    """q, k L2-normalised (q also scaled by dk^-1/2, as the model makes them), log decays g
    <= 0 of typical size ``decay``, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q, k = rand(B, T, H, dk, seed=seed + 1), rand(B, T, H, dk, seed=seed + 2)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rand(B, T, H, dv, seed=seed + 3)
    g = (-np.abs(rng.standard_normal((B, T, H))) * decay).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    return [q, k, v, g, beta]


DELTAS = {
    # name: (B, T, H, dk, dv, chunk, decay)
    "one-step": (1, 1, 1, 4, 3, 64, 0.3),
    "ragged-chunks": (2, 70, 3, 8, 12, 16, 0.3),
    "two-chunks-wide-dv": (1, 130, 2, 16, 40, 64, 0.3),
    "odd-chunk": (1, 33, 2, 24, 20, 7, 0.3),
    "chunk-past-t": (2, 9, 1, 8, 8, 64, 0.3),
    "strong-decay": (1, 100, 2, 32, 32, 64, 3.0),
}


@pytest.mark.parametrize("case", sorted(DELTAS))
def test_delta_rule(case):
    B, T, H, dk, dv, chunk, decay = DELTAS[case]
    srcs = delta_inputs(B, T, H, dk, dv, decay=decay)
    check_op("delta_rule", (B, T, H, dv), srcs, {"chunk": chunk})
    state = rand(B, H, dk, dv, seed=9) * 0.3   # generation: from a state, returning the last
    check_op("delta_rule", (B * T * H * dv + B * H * dk * dv,), srcs + [state], {"chunk": chunk})


@pytest.mark.parametrize("case", sorted(DELTAS))
def test_delta_rule_back(case):
    B, T, H, dk, dv, chunk, decay = DELTAS[case]
    srcs = delta_inputs(B, T, H, dk, dv, decay=decay)
    check_op("delta_rule_back", (sum(s.size for s in srcs),), srcs + [rand(B, T, H, dv, seed=11)],
             {"chunk": chunk})


def test_delta_refusals_keep_the_numpy_kernel():
    srcs = delta_inputs(1, 8, 2, 4, 4)
    out = np.zeros((1, 8, 2, 4), np.float32)
    assert REPLAYS["delta_rule"](None, out, srcs, {"chunk": 1025}) is None
    strided = rand(1, 8, 2, 8)[..., :4]
    assert REPLAYS["delta_rule"](None, out, [strided] + srcs[1:], {"chunk": 64}) is None
    assert REPLAYS["causal_conv1d"](None, np.zeros((1, 8, 4), np.float32),
                                    [rand(1, 8, 4), rand(4, 3).astype(np.float64)], {}) is None


# --- threads, broken kernels -------------------------------------------------------------------
def ids_across_threads(op, shape, srcs, attrs, counts=(1, 2, 3)):
    """check_bits_across_threads for an op with an i32 result."""
    results = []
    for n in counts:
        engine.set_threads(n)
        results.append(engine_result(op, shape, srcs, attrs, np.int32))
    engine.use_threads(None)
    assert all(np.array_equal(r, results[0]) for r in results[1:]), op


def test_results_do_not_depend_on_the_thread_count():
    ids = _ids(2101, 2, 60)
    ids_across_threads("group_by_expert", (61 + ids.size,), [ids], {"n_expert": 60})
    ids_across_threads("topk", (300, 4), [_scores(300, 60)], {"k": 4})
    N, k, E, n_in, n_out, used = PRODUCTS["long-group"]
    for trans_b in (True, False):
        x, w, routes = _product_operands(N, k, E, n_in, n_out, trans_b, False, used)
        check_bits_across_threads("expert_matmul", (N, k, n_out), [x, w, routes], {"trans_b": trans_b})
        check_bits_across_threads("expert_matmul_dw", w.shape, [rand(N, k, n_out), x, routes],
                                  {"trans_b": trans_b, "w_shape": w.shape})
    wb = _expert_blocks("q8_0", (3, 64, 256))
    check_bits_across_threads("expert_matmul", (N, k, 64), [rand(N, 256), wb, routes], {"trans_b": True})
    x, w, g = rand(2, 300, 200), rand(200, 4, seed=1), rand(2, 300, 200, seed=2)
    check_bits_across_threads("causal_conv1d", x.shape, [x, w], {})
    check_bits_across_threads("causal_conv1d_back", (x.size + w.size,), [x, w, g], {})
    srcs = delta_inputs(1, 100, 5, 16, 24)
    check_bits_across_threads("delta_rule", (1, 100, 5, 24), srcs, {"chunk": 32})
    check_bits_across_threads("delta_rule_back", (sum(s.size for s in srcs),),
                              srcs + [rand(1, 100, 5, 24)], {"chunk": 32})


BROKEN = {
    # name: (source text, its mutation, the op whose check must then fail)
    "the delta rule's substitution leaves out the row before": (
        "dn_gemm(1, dv, i, w.P + i * ldn, ldn, w.U, ldv, w.row, ldv, false);",
        "dn_gemm(1, dv, i - (i > 1), w.P + i * ldn, ldn, w.U, ldv, w.row, ldv, false);",
        "delta_rule"),
    "the experts gather the next token's row": (
        "memcpy(rows + r * width, x + moe_source(rt.perm[r], k, per_slot) * width,",
        "memcpy(rows + r * width, x + (moe_source(rt.perm[r], k, per_slot) + (r == 3)) * width,",
        "expert_matmul"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
                                  for i, n in enumerate(BROKEN)])
def test_a_broken_kernel_fails_its_check(name):
    old, new, op = BROKEN[name]
    broken = _broken(old, new)
    if op == "delta_rule":
        B, T, H, dk, dv, chunk, _ = DELTAS["ragged-chunks"]
        srcs, attrs, shape = delta_inputs(B, T, H, dk, dv), {"chunk": chunk}, (B, T, H, dv)
    else:
        N, k, E, n_in, n_out, used = PRODUCTS["ragged"]
        srcs, attrs, shape = list(_product_operands(N, k, E, n_in, n_out, True, False, used)), \
            {"trans_b": True}, (N, k, n_out)
    with pytest.raises(AssertionError, match="over the bound"):
        check_op(op, shape, srcs, attrs, lib=broken)


# --- the whole step ----------------------------------------------------------------------------
ATTENTION = ("q", "k", "v", "o")
EXPERT_OPS = {"topk", "take_along", "put_along", "group_by_expert", "expert_matmul",
              "expert_matmul_dw"}
DELTANET_OPS = {"causal_conv1d", "causal_conv1d_back", "delta_rule", "delta_rule_back"}


def lora_steps(path, targets, replay, monkeypatch, steps=3, seq=16, batch=2, base_memory=None):
    """(the losses of ``steps`` LoRA steps on the GGUF at ``path``, the ops of the nodes
    that kept their numpy kernel, the engine kernels the replayed runs call), the numpy
    backend replaying in the engine or not (``replay``: TOYGRAPH_CPU_REPLAY). Non-zero A
    and B on every target, rank 4, AdamW at lr 2e-3, clip 0.5."""
    from toygraph.core import numpy_backend
    from toygraph.core.optimizer import hp_row
    from toygraph.models.decoder import ALL_TARGETS, lora_shapes
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    kept, kernels = set(), set()
    plain = numpy_backend.CpuBackend._compile

    def spy(self, nodes):
        compiled = plain(self, nodes)
        for op, program, *_ in compiled:
            if op is None:
                kernels.update(program.kernels)
            else:
                kept.add(op)
        return compiled

    monkeypatch.setattr(numpy_backend.CpuBackend, "_compile", spy)
    monkeypatch.setenv("TOYGRAPH_CPU_REPLAY", replay)
    model = GGUFModel(path)
    cfg, present = model.config, model.tensor_names()
    rng = np.random.default_rng(0)
    lora = {}
    for i in range(cfg.n_layer):
        for t in targets:
            name = f"blk.{i}.{ALL_TARGETS[t]}.weight"
            if name.replace("gate_up", "gate") in present:
                a, b = lora_shapes(cfg, name, 4)
                lora[f"{name}.lora_a"] = (rng.normal(size=a) / np.sqrt(a[-1])).astype(np.float32)
                lora[f"{name}.lora_b"] = (rng.normal(size=b) * 0.5).astype(np.float32)
    recipe = LoRA(targets=targets, rank=4, alpha=8)
    recipe.realize(model, cfg, RecipeOptions(seq_len=seq, batch=batch, clip=0.5,
                                             base_memory=base_memory))
    recipe.load_trainable(lora)
    tokens = np.random.default_rng(1).integers(0, cfg.n_vocab, (1, batch, seq)).astype(np.int32)
    labels = np.concatenate([tokens[..., 1:], np.full((1, batch, 1), -1)], -1).astype(np.int32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (1, batch, 1))
    losses = [recipe.step(tokens, positions, labels, hp_row(t, 2e-3, 0.9, 0.99, 1e-8, 0.05),
                          is_first=(t == 1)) for t in range(1, steps + 1)]
    return losses, kept, kernels


def worst_rel(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "gpt-oss"])
def test_a_moe_lora_step_replays_as_numpy(name, monkeypatch):
    """tests/support/files/moe's tiny models (test_moe_models.py), LoRA on the attention
    and on the experts: 3 steps within 1e-5 of numpy's losses, every node in the engine
    (the experts ops, gpt-oss's sinks and swiglu_oai too: none keeps its numpy kernel)."""
    from support.moe_references import gguf_path
    targets = ATTENTION + ("gate_up_exps", "down_exps")
    want, _, _ = lora_steps(gguf_path(name), targets, "numpy", monkeypatch)
    got, kept, kernels = lora_steps(gguf_path(name), targets, "engine", monkeypatch)
    assert worst_rel(got, want) <= 1e-5, (got, want)
    assert not kept and EXPERT_OPS <= kernels, kept


def test_a_moe_step_with_its_experts_in_blocks(monkeypatch, tmp_path):
    """qwen3moe with its experts in q8_0, kept in their blocks: the engine multiplies on
    them (expert_matmul_blocks, forward and dx), numpy decodes each chosen expert; and the
    steps are the same bits at 1 and 2 threads."""
    from support.moe_references import requantize
    path = requantize("qwen3moe", tmp_path / "q8.gguf", {"_exps.weight": "q8_0"})
    targets = ATTENTION + ("gate_up_exps", "down_exps")
    want, _, _ = lora_steps(path, targets, "numpy", monkeypatch, base_memory="quantized")
    runs = []
    for threads in (1, 2):
        engine.use_threads(threads)
        try:
            runs.append(lora_steps(path, targets, "engine", monkeypatch, base_memory="quantized"))
        finally:
            engine.use_threads(None)
    (got, kept, kernels), (again, _, _) = runs
    assert worst_rel(got, want) <= 1e-5 and got == again, (got, again, want)
    assert "expert_matmul_blocks" in kernels and not kept & EXPERT_OPS, kept


@pytest.mark.slow
def test_a_qwen35_lora_step_replays_as_numpy(monkeypatch, tmp_path):
    """test_qwen35.py's tiny Qwen3.5 (transformers' model through llama.cpp's converter),
    2 x 80 tokens: two chunks of the delta rule. LoRA on the attention and ssm_out, 2 steps
    within 1e-5 of numpy's losses (their gradients cross the DeltaNet layers' backward:
    the attention layers are the 4th and 8th); with every projection targeted (the
    DeltaNet's qkv, z, alpha, beta too) the first step's loss. This fixture's steps
    amplify rounding: numpy's own f32 steps leave its f64 steps by 2e-4 at the second with
    every projection, by 3e-6 at the third with ssm_out, so later steps would compare
    rounding orders, not kernels (the engine is as near f64 as numpy is)."""
    from support.converted import convert
    from test_qwen35 import build
    path, _ = convert(tmp_path, "qwen35", *build(2, 4), pre="qwen35", args=("--no-mtp",))
    for targets, steps in ((ATTENTION + ("ssm_out",), 2),
                           (ATTENTION + ("qkv", "z", "alpha", "beta", "ssm_out"), 1)):
        want, _, _ = lora_steps(path, targets, "numpy", monkeypatch, steps=steps, seq=80)
        got, kept, kernels = lora_steps(path, targets, "engine", monkeypatch, steps=steps, seq=80)
        assert worst_rel(got, want) <= 1e-5, (targets, got, want)
        assert not kept & DELTANET_OPS and DELTANET_OPS <= kernels, kept
