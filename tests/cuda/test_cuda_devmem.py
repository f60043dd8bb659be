"""Device memory planned on the host (cuda/devmem.py): which frozen consts stay in their
GGUF block format (every consumer reads them through a fused kernel), which get an f32
copy, what that saves on SmolLM2-135M, and the lowering refusing a block-format const
where no fused kernel reads it."""
import numpy as np
import pytest

from support.cudaemu import (BLOCK_FORMATS, lora_graph, quant_kernels, qweight,
                             smollm2_training_graph, training_plan)
from toygraph import ops
from toygraph.gguf import blocks
from toygraph.cuda import devmem
from toygraph.ops.lowering import dispatch
from toygraph.errors import CudaError
from toygraph.core.graph import Graph


def test_lowering_refuses_a_block_format_const_where_no_fused_kernel_reads_it():
    rng = np.random.default_rng(0)
    raw, _ = qweight(rng, "q8_0", 64, 64)
    g = Graph()
    w = g.const("w", raw, shape=(64, 64), storage="q8_0")
    x = g.const("x", np.ones((64, 64)))
    for node, i in [(ops.matmul(w, x), 0), (ops.matmul(x, w, trans_a=True), 1),
                    (ops.contiguous(w), 0), (ops.matmul(w, w, trans_b=True), 1)]:
        assert not dispatch.reads_block_format(node, i)
        with pytest.raises(CudaError, match="block format"):
            dispatch.lower(node, lambda t: 1 << 20, raw_consts={w.id})
    assert dispatch.reads_block_format(ops.matmul(x, w), 1)
    assert not dispatch.reads_block_format(ops.matmul(x, x), 1)  # f32 storage


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_llama_kquant"])
def test_realize_plan_keeps_frozen_weights_in_block_format(model, request):
    g = lora_graph(request.getfixturevalue(model), targets=("q", "k", "v", "o", "gate"))
    order, pinned, plan, outputs = training_plan(g)
    consts = [t for t in order if t.role == "const" and t.storage != "f32"]
    assert consts
    mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
    old = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=False)
    for t in consts:  # every quantized const is only read by matmul / get_rows
        assert t.id not in mem.f32_buffers, t.name
        assert mem.raw_consts[t.id] == blocks.nbytes(t.storage, t.shape)
        assert old.f32_buffers[t.id] == 4 * t.size and t.id not in old.raw_consts
    assert set(mem.f32_buffers) | set(mem.raw_consts) == set(old.f32_buffers)
    assert mem.dequant_temp_bytes == 0 < old.dequant_temp_bytes
    saved = sum(4 * t.size - blocks.nbytes(t.storage, t.shape) for t in consts)
    assert mem.saved_bytes == saved == old.resident_bytes - mem.resident_bytes > 0
    assert mem.report()["saved_bytes"] == saved and old.report()["saved_bytes"] == 0
    # every node lowers, and the ones reading a block-format const use a fused kernel
    fused = {n for fmt in BLOCK_FORMATS for n in quant_kernels(fmt).values()}
    addr = {t.id: (i + 1) << 20 for i, t in enumerate(order)}
    for node in order:
        if node.op is None:
            continue
        kernels = [l.kernel for l in dispatch.lower(node, lambda t: addr[t.id], 1 << 40,
                                                    frozenset(mem.raw_consts))]
        if any(s.id in mem.raw_consts for s in node.srcs):   # (matmul_add's add: after it)
            assert set(kernels) & fused, (node.op, kernels)
            assert set(kernels) <= fused | {"tg_matmul_add_epilogue"}, (node.op, kernels)
        else:
            assert not set(kernels) & fused


def test_plan_keeps_f32_copies_where_a_consumer_needs_them(monkeypatch):
    rng = np.random.default_rng(1)
    raw, _ = qweight(rng, "q4_0", 32, 64)
    g = Graph()
    x = g.input("x", (5, 64))
    shared = g.const("shared", raw, shape=(32, 64), storage="q4_0")  # also read by contiguous
    only_mm = g.const("only_mm", raw, shape=(32, 64), storage="q4_0")
    shown = g.const("shown", raw, shape=(32, 64), storage="q4_0")    # a graph output
    g.output(ops.matmul(x, shared, trans_b=True) + ops.matmul(x, only_mm, trans_b=True))
    g.output(ops.contiguous(shared))
    g.output(shown)
    g.output(ops.matmul(x, shown, trans_b=True))
    order, pinned, plan, outputs = training_plan(g)
    assert devmem.block_format_consts(order, outputs) == {only_mm.id}
    mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
    assert set(mem.raw_consts) == {only_mm.id}
    assert shared.id in mem.f32_buffers and shown.id in mem.f32_buffers
    monkeypatch.setenv("TOYGRAPH_CUDA_QMATMUL", "0")
    assert not devmem.qmatmul_enabled()
    assert not devmem.plan_device_memory(order, plan, pinned, outputs).raw_consts
    monkeypatch.setenv("TOYGRAPH_CUDA_QMATMUL", "1")
    assert devmem.plan_device_memory(order, plan, pinned, outputs).raw_consts


def test_smollm2_frozen_weights_in_block_format_save_421_mib(smollm2):
    """SmolLM2-135M Q4_1 (Q8_0 tied embedding): 134.5 M frozen weights take 96.4 MB as
    blocks instead of 537.9 MB as f32."""
    g = lora_graph(smollm2)
    order, pinned, plan, outputs = training_plan(g)
    mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
    assert len(mem.raw_consts) == 211          # 30 layers x 7 matrices + token_embd
    assert sum(mem.raw_consts.values()) == 96_436_224
    assert mem.f32_avoided_bytes == 537_919_488
    assert mem.saved_bytes == 441_483_264      # 421.0 MiB


def test_smollm2_fused_head_plans_gibibytes_less_and_keeps_the_q8_0_head_in_blocks(smollm2):
    """SmolLM2 LoRA at batch 4 x seq 2048 planned on the host: the unfused head holds
    [8192, 49152] logits and their gradient (1.5 GiB each); the fused one a 1344-row block."""
    sizes = {}
    for fused in (False, True):
        g = smollm2_training_graph(smollm2, fused, 4, 2048)
        order, pinned, plan, outputs = training_plan(g)
        mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
        heads = [t for t in order if t.op and t.op.startswith("linear_cross_entropy")]
        sizes[fused] = (plan.arena_bytes, mem.scratch_bytes, mem,
                        sum(dispatch.scratch_bytes(t) for t in heads))
        if fused:
            embd = next(t for t in order if t.name == "token_embd.weight")
            assert embd.storage == "q8_0" and embd.id in mem.raw_consts
            assert len(mem.raw_consts) == 211
            assert [t.op for t in heads] == ["linear_cross_entropy", "linear_cross_entropy_back"]
            assert heads[1].shape == (8192 * 576,)       # dh only: the head is frozen
            for t in heads:
                kernels = {l.kernel for l in dispatch.lower(t, lambda x: 1 << 20, 1 << 40,
                                                            frozenset(mem.raw_consts))}
                assert {"tg_qmm_nt_q8_0"} <= kernels and "tg_matmul" not in kernels
    (arena_u, scr_u, *_), (arena_f, scr_f, *_) = sizes[False], sizes[True]
    logits = 8192 * 49152 * 4
    assert arena_u >= 2 * logits                 # logits and dlogits live together
    assert arena_u + scr_u - (arena_f + scr_f) >= 1.5 * logits
    assert sizes[True][3] == 2 * (1344 * 49152 * 4) + 4 * 8192 + 256  # two blocks, rowloss, gs
