"""bench/studies/roofline.py, the modelled step: per-launch FLOPs and bytes counted by hand for a
few launches of a small plan, the plan's GEMM FLOPs against the textbook count, and the
JSON's numbers consistent with each other."""
import sys
from math import ceil
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "studies"))
import roofline  # noqa: E402
from roofline_plan import (RULES, kernel_params, launch_cost, plan_launches,  # noqa: E402
                           visible_tile_pairs)

B, T, R = 2, 64, 16
D, FF, V, L, KV = 576, 1536, 512, 2, 3 * 64   # roofline.SHAPES["tiny"]: SmolLM2-wide, 2 layers


@pytest.fixture(scope="module")
def plan():
    launches, cfg, raw = plan_launches(roofline.SHAPES["tiny"], batch=B, seq=T, wtype="q8_0",
                                       precision="bf16")
    return [(n, l, launch_cost(n, l, raw)) for n, l in launches]


@pytest.fixture(scope="module")
def plan_f32():
    launches, cfg, raw = plan_launches(roofline.SHAPES["tiny"], batch=B, seq=T, wtype="q8_0",
                                       precision="f32")
    return [(n, l, launch_cost(n, l, raw)) for n, l in launches]


@pytest.fixture(scope="module")
def result():
    return roofline.model("tiny-2x64")


def _one(plan, kernel, where):
    found = [(n, l, c) for n, l, c in plan if l.kernel == kernel and where(n, l)]
    assert found, kernel
    return found[0]


def test_lora_a_forward_gemm_counted_from_its_launch(plan):
    # x [B*T, D] @ A^T [D, R] for layer 0's q: a 128 x 128 tile per block, K in 32-slices,
    # the operands in bf16 (tc_gemm.cu): x, the attn_norm's output, as the norm stored it
    # (no copy), A copied from f32 by tg_tcg_to_bf16
    where = (lambda n, l: n.op == "matmul" and n.srcs[1].name == "blk.0.attn_q.weight.lora_a"
             and not n.attrs["trans_a"])
    n, l, c = _one(plan, "tg_tcg_gemm_bf16", where)
    M, K = B * T, D
    # one output tile, so k = D splits (split_count: 18 slices -> 4 splits of 5, 5, 5, 3)
    from toygraph.ops.gemm.cuda_tc import split_count
    splits = split_count(1, K)
    assert splits == 4 and ceil(M / 128) == 1
    assert c.useful == 2 * M * R * K
    assert c.blocks == splits and c.tc == splits * 128 * 128 * 5 * 32 * 2
    assert c.bytes == 2 * (M * K + R * K) + 4 * M * R * splits
    assert c.kind == "gemm tensor-core (cp.async + ldmatrix)"
    copies = [c for n2, l2, c in plan if n2 is n and l2.kernel == "tg_tcg_to_bf16"]
    assert [c.bytes for c in copies] == [6 * R * K]


def test_split_k_gemm_counts_every_split_as_blocks_and_the_sum():
    from roofline_plan import launch_cost as cost_of
    from toygraph.ops.gemm.cuda_tc import Gemm, gemm_launches
    g = Gemm(576, 16, 4096, 1, 576, 16, 1)     # a LoRA dA at 8 x 512 tokens: K = tokens
    assert g.splits == 26
    costs = [cost_of(type("Node", (), {"name": "dA"})(), l) for l in gemm_launches(g, 1 << 32, 1 << 32, 1 << 32, 1 << 32, "t")]
    gemm, total = costs[2], costs[3]
    per = ceil(4096 / 32 / 26)
    assert gemm.blocks == 5 * 1 * 26 and gemm.tile_flops == 2 * 128 * 128 * per * 32
    assert gemm.useful == 2 * 576 * 16 * 4096
    assert gemm.bytes == 2 * (576 + 16) * 4096 + 4 * 576 * 16 * 26
    assert total.bytes == 4 * 27 * 576 * 16 and total.fma == 25 * 576 * 16


def test_block_format_gemm_reads_block_bytes(plan):
    # x @ W^T with layer 0's ffn_up in q8_0: 34 bytes per 32 weights, decoded once into
    # the bf16 copy tc_gemm.cu reads (the cost model's pick for this shape)
    up = lambda n, l: n.srcs[1].name == "blk.0.ffn_up.weight"   # noqa: E731
    n, l, c = _one(plan, "tg_tcg_deq_nt_q8_0", up)
    assert c.bytes == FF * D // 32 * 34 + 2 * FF * D
    n, l, c = _one(plan, "tg_tcg_gemm_bf16", up)
    from toygraph.ops.gemm.cuda_tc import split_count
    assert c.useful == 2 * B * T * FF * D
    assert c.blocks == ceil(FF / 128) * split_count(ceil(FF / 128), D) == 12 * 4
    # the direct kernel's cost of the same product reads the block bytes in its tile loop
    from toygraph.ops.gemm.cuda import _qmatmul
    q = _qmatmul(n, 1 << 32, lambda t: 1 << 32, tile=128)
    q.kernel = "tg_tc_qmm_nt_q8_0_bf16"
    c = launch_cost(n, q, frozenset({n.srcs[1].id}))
    assert c.bytes == 4 * B * T * D + FF * D // 32 * 34 + 4 * B * T * FF


def test_tile_kernels_are_charged_whole_waves():
    from roofline_plan import Cost
    dev = roofline.DEVICES["h100"]
    eff = {"gemm tensor-core": (0.5, 1.0)}
    per_tile = 1e9
    one_wave = Cost("k", "gemm tensor-core", tc=132 * per_tile, blocks=132, tile_flops=per_tile)
    t1 = roofline.predict(one_wave, dev, eff, 0.0)
    assert t1 == pytest.approx(per_tile / (989e12 * 0.5 / 132))
    # one block more is a second wave: twice the time for 0.8% more work
    two = Cost("k", "gemm tensor-core", tc=133 * per_tile, blocks=133, tile_flops=per_tile)
    assert roofline.predict(two, dev, eff, 0.0) == pytest.approx(2 * t1)


def test_attention_forward_counts_visible_tiles(plan_f32):
    n, l, c = _one(plan_f32, "tg_attn_fwd_64", lambda n, l: True)
    pairs = 3        # 2 tiles of 32 rows, causal: (0,0), (1,0), (1,1)
    scores = B * 9 * pairs * 32 * 32
    assert c.fma == 2 * 2 * scores * 64 and c.sfu == scores and c.tc == 0
    # q, o, k, v and the saved row log-sum-exp L
    assert c.bytes == 4 * (2 * B * 9 * T * 64 + 2 * B * 3 * T * 64 + B * 9 * T)


def test_the_step_permutes_nothing_around_attention(plan, plan_f32):
    """Token-major attention: no tg_gather (the permutes of q, k, v, o and their gradients)
    in the step, and the backward has no statistics pass (one forward per layer)."""
    for p in (plan, plan_f32):
        assert not [l for n, l, c in p if l.kernel == "tg_gather"]
    assert sum(l.kernel.startswith("tg_tca_fwd_") for n, l, c in plan) == L


def test_adamw_is_one_launch_moving_seven_f32_per_weight(plan):
    """28 LoRA tensors (2 layers x 7 targets x A, B): one multi-tensor launch for AdamW and
    one for the norm's squares, over every LoRA weight."""
    lora = L * R * (9 * D + 2 * KV + 3 * FF)   # q, o: D + D; k, v: D + KV; gate, up, down: D + FF
    (adam,) = [c for n, l, c in plan if l.kernel == "tg_adamw_list"]
    (sumsq,) = [c for n, l, c in plan if l.kernel == "tg_sumsq_list"]
    assert adam.bytes == 28 * lora and sumsq.bytes == 4 * lora


def test_the_gated_backward_reads_three_and_writes_two(plan, plan_f32):
    """gate, up and the gradient in, d gate and d up out: all in bf16 at bf16 (products
    make the three and only products read the two, cuda/bf16_storage.py), f32 at f32."""
    from toygraph.ops.gated import up_offset
    n = B * T * FF
    c = [c for nd, l, c in plan if l.kernel == "tg_glu_back"][0]
    assert c.bytes == 2 * (3 * n + up_offset(n) + n)
    c = [c for nd, l, c in plan_f32 if l.kernel == "tg_glu_back"][0]
    assert c.bytes == 4 * (3 * n + up_offset(n) + n)
    assert sum(1 for nd, l, c in plan if l.kernel in ("tg_silu", "tg_silu_back")) == 0


def test_visible_tile_pairs_match_element_masks():
    for T_, BQ, BK, window in [(64, 32, 32, 0), (100, 32, 32, 0), (96, 16, 16, 20),
                               (50, 16, 16, 7), (200, 64, 32, 0), (200, 32, 64, 0),
                               (130, 64, 16, 40)]:
        brute = sum(any(j <= i and (not window or i - j < window)
                        for i in range(q0, min(T_, q0 + BQ)) for j in range(k0, min(T_, k0 + BK)))
                    for q0 in range(0, T_, BQ) for k0 in range(0, T_, BK))
        assert visible_tile_pairs(T_, BQ, BK, True, window) == brute
    assert visible_tile_pairs(64, 32, 32, False, 0) == 4


def test_plan_gemm_flops_match_the_textbook_count(plan):
    """4 N_base T (forward + input gradients) + 6 N_lora T, plus the fused head's backward
    recomputing the logits (2 V D T), less what autodiff prunes: layer 0's q/k/v inputs
    come from the frozen embedding, so their input gradients (base and LoRA A) are never
    formed."""
    mats = [(D, D), (KV, D), (KV, D), (D, D), (FF, D), (FF, D), (D, FF)]
    tok = B * T
    n_base = L * sum(o * i for o, i in mats) + V * D
    n_lora = L * sum(R * (o + i) for o, i in mats)
    pruned = sum(o * i + R * i for o, i in mats[:3])
    expect = 4 * n_base * tok + 6 * n_lora * tok + 2 * V * D * tok - 2 * pruned * tok
    got = sum(c.useful for _, _, c in plan if c.kind.startswith("gemm"))
    assert got == expect


def test_json_numbers_are_consistent(result):
    r = result
    for key in ("predicted_tokens_per_s", "attention_tensor_core_fraction",
                "torch_eager_estimate_tokens_per_s"):
        assert key in r and r[key] >= 0
    classes = r["toygraph"]["classes"]
    step = sum(c["seconds"] for c in classes.values()) + roofline.TOYGRAPH_HOST_S
    assert r["predicted_step_s"] == pytest.approx(step)
    assert r["predicted_tokens_per_s"] == pytest.approx(B * T / step)
    assert sum(c["launches"] for c in classes.values()) == r["launches"]
    kernels = r["toygraph"]["kernels"].values()
    for field in ("seconds", "bytes", "tc_flops", "f32_flops", "launches"):
        assert sum(k[field] for k in kernels) == pytest.approx(sum(c[field] for c in classes.values()))
    attn = [c for k, c in classes.items() if k.startswith("attention")]
    tc = sum(c["tc_flops"] for c in attn)
    assert r["attention_tensor_core_fraction"] == pytest.approx(tc / (tc + sum(c["f32_flops"] for c in attn)))
    t = r["torch_eager"]
    torch_step = max(t["gpu_s"], t["host_s"])
    assert t["gpu_s"] == pytest.approx(sum(c["seconds"] for c in t["classes"].values()))
    assert r["torch_eager_estimate_tokens_per_s"] == pytest.approx(B * T / torch_step)
    assert r["speedup_vs_torch_eager"] == pytest.approx(torch_step / step)


def test_f32_attention_runs_on_cuda_cores():
    r = roofline.model("tiny-2x64", precision="f32", torch_side=False)
    assert r["attention_tensor_core_fraction"] == 0.0
    assert r["toygraph"]["classes"]["attention"]["f32_flops"] > 0


def test_tensor_core_attention_counted_per_pass(plan, monkeypatch):
    """tc_attention.cu's forward (issue 25), costed from a launch with its arguments: blocks
    of 64 queries, key tiles of 64 at head dim 64; saving L adds its bytes, no pass."""
    from toygraph.ops.lowering import Launch, constants, i32_arg, ptr_arg
    monkeypatch.setattr(constants, "TCA_BQ", 64, raising=False)
    monkeypatch.setattr(constants, "TCA_TILES", {64: 64}, raising=False)
    node = next(n for n, _, _ in plan if n.op == "attention")
    scores = B * 9 * 1 * 64 * 64          # T = 64: one causal (block, tile) pair per head
    full = launch_cost(node, Launch("tg_tca_fwd_64", (1, 9, B), [ptr_arg(1), ptr_arg(0)]))
    saving = launch_cost(node, Launch("tg_tca_fwd_64", (1, 9, B), [ptr_arg(1), ptr_arg(1)]))
    assert full.tc == 2 * 2 * scores * 64 and full.fma == 0 and full.sfu == scores
    assert saving.tc == full.tc and saving.bytes == full.bytes + 4 * B * 9 * 64
    assert full.kind == "attention tensor-core"
    cast = launch_cost(node, Launch("tg_tca_to_bf16", (1, 1, 1), [  # 10 f32 rows of 60
        ptr_arg(1), ptr_arg(1), i32_arg(10), i32_arg(60), i32_arg(64), i32_arg(1), i32_arg(10),
        i32_arg(0), i32_arg(0)]))
    assert cast.bytes == 4 * 10 * 60 + 2 * 10 * 64


def test_tensor_core_attention_launches_of_the_plan(plan):
    """Where the bf16 attention lowers to tc_attention.cu (issue 25), its launches in the
    plan: the forward's two passes over T = 64 (one block, one tile per head)."""
    fwd = [(n, l, c) for n, l, c in plan if l.kernel.startswith("tg_tca_fwd_")]
    if not fwd:
        pytest.skip("this tree's bf16 attention has no tensor-core kernels yet")
    n, l, c = next(x for x in fwd if x[0].op == "attention")
    assert c.tc == 2 * 2 * (B * 9 * 64 * 64) * 64


def test_torch_trace_launches_flash_attention_and_f32_adapters(result):
    cls = result["torch_eager"]["classes"]
    kernels = result["torch_eager"]["kernels"]
    # one FA2 forward and three backward kernels per layer, on tensor cores
    assert cls["attention"]["launches"] == 4 * L and cls["attention"]["tc_flops"] > 0
    # PEFT keeps adapters f32 on a bf16 model: 6 GEMMs per adapter pair (2 fwd, 4 bwd),
    # less layer 0's q/k/v input gradient through A
    assert kernels["cublas_mm_f32 [gemm cuBLAS f32 (CUDA cores)]"]["launches"] == L * 7 * 6 - 3


def test_unknown_kernel_is_refused(plan):
    from toygraph.ops.lowering import Launch
    node = plan[0][0]
    with pytest.raises(ValueError, match="tg_new_kernel"):
        launch_cost(node, Launch("tg_new_kernel", (1, 1, 1)))


# --- the cost rules against the kernels ---------------------------------------------------------
def test_every_cost_rule_names_kernels_that_exist():
    """A rule whose pattern no kernel of the sources matches is stale (a kernel renamed or
    gone): each pattern matches at least one kernel the op families declare."""
    kernels = set(kernel_params())
    assert len(kernels) > 100
    dead = [pattern for pattern, _ in RULES
            if not any(__import__("re").fullmatch(pattern, k) for k in kernels)]
    assert not dead, dead


def test_every_kernel_an_op_lowers_to_in_the_step_has_a_rule(plan, plan_f32):
    """The ops of the modelled step lower to kernels listed in the registry; each of those
    kernels has a cost rule (launch_cost raises on a kernel without one)."""
    import re
    from toygraph.ops.lowering.registry import op_kernels
    ops_in_step = {n.op for n, _, _ in plan + plan_f32}
    listed = {k for op in ops_in_step for k in op_kernels()[op]}
    launched = {l.kernel for _, l, _ in plan + plan_f32}
    assert listed & launched
    missing = [k for k in listed | launched
               if not any(re.fullmatch(pattern, k) for pattern, _ in RULES)]
    assert not missing, missing


def test_a_rule_reads_arguments_by_the_kernels_parameter_names(plan, monkeypatch):
    """The GEMM rule reads M, N and K by name: with the kernels' parameter lists as the
    sources give them it counts the textbook FLOPs, and with a parameter renamed it fails
    naming the kernel and the parameter instead of counting from the wrong argument."""
    import roofline_plan
    n, l, c = next((n, l, c) for n, l, c in plan if l.kernel == "tg_tcg_gemm_bf16")
    assert launch_cost(n, l).useful == c.useful > 0
    renamed = dict(kernel_params())
    renamed[l.kernel] = tuple("rows" if p == "M" else p for p in renamed[l.kernel])
    monkeypatch.setattr(roofline_plan, "kernel_params", lambda: renamed)
    with pytest.raises(ValueError, match="reads parameter 'M' of tg_tcg_gemm_bf16"):
        launch_cost(n, l)
