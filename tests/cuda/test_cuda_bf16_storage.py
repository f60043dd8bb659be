"""--precision bf16's activations kept in bf16 (cuda/bf16_storage.py): which tensors the plan
picks, the buffer plan's 2-byte buffers and views, and the arithmetic.

The exactness argument: at bf16 every matmul rounds its operands to bf16 before the
GEMM, so an activation that only such products read (unscaled) gives the same GEMM
operand whether it is stored in f32 and rounded by the GEMM's copy or rounded once when
stored -- the results must agree bit for bit, forward and backward. A LoRA step, whose
products also scale a bf16 operand (s dy), rounds twice there and so only tracks it.
"""
import numpy as np
import pytest

from support.cudaemu import lora_graph, training_plan
from support.hostparity import MIXED_TOL, rel_err, rnd, run_phase
from support.tiers import one_by_default
from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.core.buffer_plan import plan_buffers
from toygraph.ops.lowering.registry import REGISTRY
from toygraph.cuda.bf16_storage import plan_bf16


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def _readers(order):
    out = {}
    for node in order:
        for i, s in enumerate(node.srcs):
            out.setdefault(s.id, []).append((node, i))
    return out


def test_the_plan_keeps_in_bf16_only_what_bf16_readers_read(tiny_llama):
    g = lora_graph(tiny_llama, targets=("q", "k", "v", "o", "gate", "up", "down"))
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    by_id = {t.id: t for t in order}
    glus = [t for t in order if t.op == "glu"]
    for t in glus:      # each layer's act, and the gate and up products it reads
        assert {t.id, t.srcs[0].id, t.srcs[1].id} <= half
        for proj in t.srcs:   # LoRA's x W^T + s u B: u in bf16, the add (base product) f32
            assert proj.op == "matmul_add" and proj.srcs[1].id in half
    # A matmul_add's add is a sum of gradient contributions (or the base product): f32, so
    # no partial sum of a reduction is rounded to bf16.
    adds = [t.srcs[0] for t in order if t.op == "matmul_add"]
    assert adds and not any(a.id in half for a in adds)
    assert any(by_id[i].op == "glu_back" for i in half)
    residual = [t for t in order if t.op == "rms_norm"][0].srcs[0]
    assert residual.id not in half
    readers = _readers(order)
    for i in half:
        t = by_id[i]
        assert t.id not in pinned and t.role is None
        assert t.op in ("reshape", "contiguous", "unpack") or REGISTRY[t.op].bf16_writes
        for node, k in readers.get(i, []):
            assert node.id in half or REGISTRY[node.op].reads_bf16(node, k), (node.op, k)
    for prec in ("f32", "tf32"):
        assert plan_bf16(order, pinned, prec) == frozenset()


def test_a_reader_that_needs_f32_keeps_the_tensor_f32():
    rng = np.random.default_rng(0)
    g = Graph()
    gate, up = g.param("gate", rnd(rng, 8, 16)), g.param("up", rnd(rng, 8, 16))
    w = g.param("w", rnd(rng, 16, 4))
    only_mm = ops.glu(gate, up, "silu")
    also_add = ops.glu(up, gate, "silu")
    shown = ops.glu(gate, gate, "silu")
    out = g.output(ops.add(ops.matmul(only_mm, w), ops.matmul(also_add, w)))
    g.output(ops.add(also_add, also_add))      # an elementwise reader: f32
    g.output(shown)                            # an output: downloaded as f32
    order, pinned, _, _ = training_plan(g)
    assert out.id in pinned
    assert plan_bf16(order, pinned, "bf16") == {only_mm.id}


def test_an_unpack_view_off_the_bf16_alignment_keeps_its_buffer_f32():
    """64 f32 elements are 256 bytes, 64 bf16 only 128: that view could not stay a view."""
    rng = np.random.default_rng(1)
    g = Graph()
    gate, up = g.param("gate", rnd(rng, 4, 32)), g.param("up", rnd(rng, 4, 32))
    act = ops.glu(gate, up, "silu")
    flat = ops.reshape(act, (128,))
    ok = ops.reshape(ops.unpack(flat, 0, (64,)), (4, 16))
    off = ops.reshape(ops.unpack(flat, 64, (64,)), (4, 16))
    w = g.param("w", rnd(rng, 16, 3))
    g.output(ops.add(ops.matmul(ok, w), ops.matmul(off, w)))
    order, pinned, _, _ = training_plan(g)
    assert plan_bf16(order, pinned, "bf16") == frozenset()


def _no_two_live_buffers_overlap(order, pinned, plan):
    """Every arena tensor's bytes, from the node that makes it to its last reader (a node
    absorbing a reader counts as reading that reader's sources), touch no other live one."""
    from toygraph.core.buffer_plan import views
    pos = {t.id: i for i, t in enumerate(order)}
    root = views(order, pinned, 4, plan.bf16)
    life = {}
    for i, t in enumerate(order):
        at = pos[plan.absorbed[t.id].id] if t.id in plan.absorbed else i
        for s in t.srcs:
            r = root.get(s.id, s.id)
            if r in life:
                life[r] = (life[r][0], max(life[r][1], at))
        if t.id in plan.offsets and t.id not in root:
            life[t.id] = (i, i)
    by_id = {t.id: t for t in order}
    spans = []
    for tid, (a, b) in life.items():
        size = by_id[tid].size * (2 if tid in plan.bf16 else 4)
        spans.append((plan.offsets[tid], plan.offsets[tid] + size, a, b, tid))
    for i, (o1, e1, a1, b1, t1) in enumerate(spans):
        for o2, e2, a2, b2, t2 in spans[i + 1:]:
            if o1 < e2 and o2 < e1:
                assert b1 < a2 or b2 < a1, (by_id[t1].name, by_id[t2].name)


def test_the_buffer_plan_gives_bf16_tensors_two_bytes_and_absorbed_ones_none(tiny_llama):
    from toygraph.cuda.bf16_storage import plan_storage
    g = lora_graph(tiny_llama, targets=("q", "v", "gate", "up", "down"))
    order, pinned, f32_plan, _ = training_plan(g)
    storage = plan_storage(order, pinned, "bf16")
    plan = plan_buffers(order, pinned, 4, storage=storage)
    assert plan.bf16 == storage.bf16 and plan.absorbed == storage.absorbed
    assert plan.arena_bytes < f32_plan.arena_bytes and plan.naive_bytes < f32_plan.naive_bytes
    for t in order:
        if t.op == "unpack" and t.id in plan.bf16:      # glu_back's d up: 2-byte offsets
            src = t.srcs[0]
            assert plan.offsets[t.id] == plan.offsets[src.id] + 2 * t.attrs["offset"]
    assert storage.absorbed and not set(storage.absorbed) & set(plan.offsets)
    _no_two_live_buffers_overlap(order, pinned, plan)
    _no_two_live_buffers_overlap(order, pinned, f32_plan)


def test_every_lora_projection_runs_as_one_dual_gemm(tiny_llama):
    """x W^T + s (x A^T) B^T: the base product is absorbed by the adapter's matmul_add (one
    tg_tcg_gemm2_bf16, the base's weight decoded once into its copy, s in B's copy), and
    so is the backward's dy W of dx = dy W + du A; at f32 nothing is."""
    from toygraph.ops.lowering import dispatch
    from toygraph.cuda.bf16_storage import plan_storage
    g = lora_graph(tiny_llama, targets=("q", "k", "v", "o", "gate", "up", "down"))
    order, pinned, _, outputs = training_plan(g)
    storage = plan_storage(order, pinned, "bf16")
    lora = [t for t in order if t.op == "matmul_add" and t.srcs[2].role == "param"
            and t.attrs["trans_b"]]                  # y + s u B^T (the backward's: du A)
    n_layer = sum(1 for t in order if t.op == "glu")
    assert len(lora) == 7 * n_layer
    for m in lora:
        assert storage.absorbed.get(m.srcs[0].id) is m, m.name
    backward = [m for m in storage.absorbed.values() if not m.attrs["trans_b"]]
    assert backward                                   # dx = dy W + du A
    assert plan_storage(order, pinned, "f32") == (frozenset(), {})
    from toygraph.cuda.devmem import plan_device_memory
    plan = plan_buffers(order, pinned, 4, storage=storage)
    raw = frozenset(plan_device_memory(order, plan, pinned, outputs, qmatmul=True).raw_consts)
    ptr = lambda t: (t.id + 1) << 30   # noqa: E731
    for m in lora:
        assert dispatch.lower(m.srcs[0], ptr, 1 << 40, raw, "bf16", storage.bf16,
                              storage.absorbed) == []
        launches = dispatch.lower(m, ptr, 1 << 40, raw, "bf16", storage.bf16, storage.absorbed)
        assert [l.kernel for l in launches][-1] == "tg_tcg_gemm2_bf16"
        assert any(l.kernel.startswith("tg_tcg_deq_") for l in launches)
        b_copy = [l for l in launches if l.kernel == "tg_tcg_to_bf16"
                  and int(l.args[1][0]) == ptr(m.srcs[2])]
        assert len(b_copy) == 1 and float(b_copy[0].args[9][0]) == np.float32(m.attrs["alpha"])


def _ffn(seed=0):
    """z = (silu(x Wg) * (x Wu)) Wd with every weight trainable (no scaled operand)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.param("x", rnd(rng, 40, 24))
    wg, wu = g.param("wg", rnd(rng, 24, 48, s=0.2)), g.param("wu", rnd(rng, 24, 48, s=0.2))
    wd = g.param("wd", rnd(rng, 48, 16, s=0.2))
    act = ops.glu(ops.matmul(x, wg), ops.matmul(x, wu), "silu")
    z = g.output(ops.matmul(act, wd))
    loss = ops.sum(ops.mul(z, g.const("r", rnd(rng, 40, 16))))
    grads = accumulate_grads(backward(loss, [x, wg, wu, wd]))
    return g, [z] + [grads[p] for p in (x, wg, wu, wd)], act


def _chain(seed=0):
    """z = ((x W1) W2) W3: the products' outputs are read by products only."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.param("x", rnd(rng, 40, 24))
    ws = [g.param(f"w{i}", rnd(rng, 24, 24, s=0.3)) for i in range(3)]
    h = x
    for w in ws:
        h = ops.matmul(h, w)
    z = g.output(h)
    loss = ops.sum(ops.mul(z, g.const("r", rnd(rng, 40, 24))))
    grads = accumulate_grads(backward(loss, [x, *ws]))
    return g, [z] + [grads[p] for p in (x, *ws)]


def _both_ways(build, monkeypatch):
    """The graph's fetches at bf16 with the activations kept in bf16, and with every buffer
    f32 (TOYGRAPH_CUDA_BF16_ACTIVATIONS=0), and the first run's bf16 set."""
    g, fetch, *_ = build()
    order, pinned, _, _ = training_plan(g)
    stored = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    monkeypatch.setenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "0")
    g2, fetch2, *_ = build()
    plain = run_phase(g2, "cuda", {}, "backward", fetch2, "bf16")
    monkeypatch.delenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS")
    return stored, plain, plan_bf16(order, pinned, "bf16")


def test_bf16_storage_of_what_only_products_read_changes_no_bit(monkeypatch):
    """Made by glu / glu_back, read only by unscaled products (the products' own outputs
    kept f32 here), or made by products and read only by products: the same bits."""
    from dataclasses import replace
    for op in ("matmul", "matmul_add"):
        monkeypatch.setitem(REGISTRY, op, replace(REGISTRY[op], bf16_writes=False))
    stored, plain, half = _both_ways(_ffn, monkeypatch)
    assert len(half) >= 3                      # act, glu_back's packed pair and its views
    for name, a, b in zip(("z", "dx", "dwg", "dwu", "dwd"), stored, plain):
        assert np.array_equal(a, b), (name, float(np.abs(a - b).max()))
    monkeypatch.undo()
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    stored, plain, half = _both_ways(_chain, monkeypatch)
    assert len(half) == 4        # x W1, x W1 W2 and, in the backward, their gradients
    for a, b in zip(stored, plain):
        assert np.array_equal(a, b), float(np.abs(a - b).max())


def test_a_glu_reading_bf16_products_tracks_the_f32_storage(monkeypatch):
    """With the gate and up products kept in bf16 too, glu computes from rounded inputs:
    within bf16's rounding of the f32-storage run, not equal to it."""
    stored, plain, half = _both_ways(_ffn, monkeypatch)
    for name, a, b in zip(("z", "dx", "dwg", "dwu", "dwd"), stored, plain):
        assert rel_err(a, b) <= MIXED_TOL["bf16"], (name, rel_err(a, b))
    assert not np.array_equal(stored[0], plain[0])


def test_the_switches_turn_them_off(monkeypatch, tiny_llama):
    from toygraph.core.session import Session
    monkeypatch.setenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "0")
    monkeypatch.setenv("TOYGRAPH_CUDA_DUAL_GEMM", "0")
    s = Session(lora_graph(tiny_llama, targets=("gate", "up", "down")), backend="cuda",
                precision="bf16")
    s.realize()
    assert s.plan.bf16 == frozenset() and s.plan.absorbed == {}


def test_a_store_that_truncates_instead_of_rounding_fails(monkeypatch):
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    old = "return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);"
    real = sources.backend_source("bf16")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    g2, fetch2 = _chain()
    monkeypatch.setenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "0")
    plain = run_phase(g2, "cuda", {}, "backward", fetch2, "bf16")
    monkeypatch.delenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS")
    monkeypatch.setattr(cuda_backend, "backend_source",
                        lambda precision="bf16": real.replace(old, "return (unsigned short)(u >> 16);"))
    g, fetch = _chain()
    stored = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    assert not np.array_equal(stored[0], plain[0])


def test_a_product_reads_a_canonical_bf16_operand_as_it_is():
    """act [40, 48] (k contiguous, 48 a multiple of 8) is A of act @ Wd: no copy of it; nor
    in dWd = act^T dz, which reads it k-major (tg_tcg_gemm_ta*)."""
    from toygraph.ops.lowering import dispatch
    g, fetch, act = _ffn()
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    ptr = lambda t: (t.id + 1) << 30   # noqa: E731
    readers = [n for n in order if n.op in ("matmul", "matmul_add") and act in n.srcs]
    assert len(readers) == 2
    for node in readers:
        launches = dispatch.lower(node, ptr, 1 << 40, precision="bf16", bf16=half)
        copies = [l for l in launches if l.kernel == "tg_tcg_to_bf16"]
        from_act = [l for l in copies if int(l.args[1][0]) == ptr(act)]
        gemm = next(l for l in launches if l.kernel.startswith("tg_tcg_gemm"))
        assert not from_act
        if node.srcs[-2] is act and not node.attrs["trans_a"]:
            assert gemm.kernel == "tg_tcg_gemm_bf16" and int(gemm.args[1][0]) == ptr(act)
        else:   # dWd = act^T dz: act read k-major as it lies
            assert gemm.kernel.startswith("tg_tcg_gemm_ta") and int(gemm.args[1][0]) == ptr(act)


def test_a_scaled_canonical_bf16_operand_is_scaled_in_the_store():
    """(s act) @ W with act kept in bf16 in the copy's layout: no pass over act; the GEMM's
    store multiplies by s (alpha), and the result tracks numpy's f32 (s act) @ W."""
    from toygraph.ops.lowering import dispatch
    rng = np.random.default_rng(4)
    g = Graph()
    gate, up = g.param("gate", rnd(rng, 64, 40)), g.param("up", rnd(rng, 64, 40))
    w = g.param("w", rnd(rng, 40, 24))
    act = ops.glu(gate, up, "silu")
    y = g.output(ops.matmul(act, w, scale_a=-0.37))
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    assert act.id in half
    ptr = lambda t: (t.id + 1) << 30   # noqa: E731
    launches = dispatch.lower(y, ptr, 1 << 40, precision="bf16", bf16=half)
    assert not [l for l in launches if l.kernel == "tg_tcg_to_bf16" and int(l.args[1][0]) == ptr(act)]
    gemm = next(l for l in launches if l.kernel == "tg_tcg_gemm_bf16")
    assert int(gemm.args[1][0]) == ptr(act) and float(gemm.args[-2][0]) == np.float32(-0.37)
    got, = run_phase(g, "cuda", {}, "forward", [y], "bf16")
    want, = run_phase(g, "cpu", {}, "forward", [y])
    assert rel_err(got, want) <= MIXED_TOL["bf16"]


def _k_major(a_half: bool, b_half: bool, seed=0, T=70, F=136, G=40):
    """act^T @ y (k = T, the tokens): act [T, F] and y [T, G] kept in bf16 (glu outputs)
    or f32 params, read k-major as they lie by tg_tcg_gemm_{ta,tb,tab}_bf16; also the
    gradients, which read them again the other way."""
    rng = np.random.default_rng(seed)
    g = Graph()

    def operand(name, cols, half):
        if half:
            return ops.glu(g.param(name + "_g", rnd(rng, T, cols)),
                           g.param(name + "_u", rnd(rng, T, cols)), "silu")
        return g.param(name, rnd(rng, T, cols))
    act, y = operand("act", F, a_half), operand("y", G, b_half)
    z = g.output(ops.matmul(act, y, trans_a=True))
    loss = ops.sum(ops.mul(z, g.const("r", rnd(rng, F, G))))
    params = [t for t in g.by_role("param")]
    grads = accumulate_grads(backward(loss, params))
    return g, [z] + [grads[p] for p in params], z


@pytest.mark.parametrize("a_half,b_half,kernel", [(True, True, "tg_tcg_gemm_tab_bf16"),
                                                  (True, False, "tg_tcg_gemm_ta_bf16"),
                                                  (False, True, "tg_tcg_gemm_tb_bf16")])
def test_k_major_bf16_operands_are_read_as_they_lie_and_change_no_bit(a_half, b_half, kernel,
                                                                      monkeypatch):
    """No transposing copy of a k-major bf16 operand: the GEMM stages its [k][r] rows and
    takes fragments with ldmatrix.trans -- the same bf16 products in the same k order as
    the copied operand, so the same bits as with every buffer f32."""
    from toygraph.ops.lowering import dispatch
    g, fetch, z = _k_major(a_half, b_half)
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    ptr = lambda t: (t.id + 1) << 30   # noqa: E731
    launches = dispatch.lower(z, ptr, 1 << 40, precision="bf16", bf16=half)
    assert [l.kernel for l in launches if "gemm" in l.kernel] == [kernel]
    assert not [l for l in launches if l.kernel == "tg_tcg_to_bf16"
                and int(l.args[1][0]) in {ptr(s) for s in z.srcs if s.id in half}]
    stored = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    monkeypatch.setenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "0")
    g2, fetch2, _ = _k_major(a_half, b_half)
    plain = run_phase(g2, "cuda", {}, "backward", fetch2, "bf16")
    assert np.array_equal(stored[0], plain[0]), float(np.abs(stored[0] - plain[0]).max())


@pytest.mark.parametrize("old,new", one_by_default([
    ("tg_ldmatrix<4, true>(a, As + (kk + 8 * (lane >> 4) + (lane & 7)) * TCG_LDT",
     "tg_ldmatrix<4, true>(a, As + (kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * TCG_LDT"),
    ("+ wn + 8 * j + 8 * (lane >> 4));", "+ wn + 8 * j + 8 * ((lane >> 3) & 1));"),
    ("const bool in = k0 + k < K && r0 + rc < R;", "const bool in = k0 + k <= K && r0 + rc < R;"),
]))
def test_a_broken_k_major_fragment_or_bound_fails(old, new, monkeypatch):
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    real = sources.backend_source("bf16")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    g, fetch, _ = _k_major(True, True, T=70)
    want = run_phase(g, "cpu", {}, "forward", fetch[:1])
    monkeypatch.setattr(cuda_backend, "backend_source",
                        lambda precision="bf16": real.replace(old, new))
    g2, fetch2, _ = _k_major(True, True, T=70)
    got = run_phase(g2, "cuda", {}, "forward", fetch2[:1], "bf16")
    assert not rel_err(got[0], want[0]) <= MIXED_TOL["bf16"]


# --- the norms: the normalized rows products read, and the gradients made by products ----------
def _normed_products(seed=0):
    """z = rms_norm(x + x W1, w) W2 + (rms_norm((x W3) per head, wh) rows) W4: a residual
    pre-norm and a per-head q/k-style norm between products, everything trainable. The
    graph, its fetch list [z, d x, d w, d wh, d W1..W4] and the norms."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.param("x", rnd(rng, 40, 64))
    w1, w2, w3, w4 = (g.param(f"w{i}", rnd(rng, 64, 64, s=0.15)) for i in range(1, 5))
    w, wh = g.param("w", 1 + rnd(rng, 64, s=0.2)), g.param("wh", 1 + rnd(rng, 16, s=0.2))
    pre = ops.rms_norm(x + ops.matmul(x, w1), 1e-5, weight=w)
    head = ops.rms_norm(ops.reshape(ops.matmul(x, w3), (40, 4, 16)), 1e-5, weight=wh)
    z = g.output(ops.add(ops.matmul(pre, w2), ops.matmul(ops.reshape(head, (40, 64)), w4)))
    loss = ops.sum(ops.mul(z, g.const("r", rnd(rng, 40, 64))))
    params = [x, w, wh, w1, w2, w3, w4]
    grads = accumulate_grads(backward(loss, params))
    return g, [z] + [grads[p] for p in params], (pre, head)


def test_the_plan_keeps_the_norms_bf16_readers_and_writers_bf16():
    """The pre-norm's output (products read it), the per-head norm's input (a product) and
    output, rms_norm_back's g (made by products); the residual stream, the weights'
    gradients and rms_norm_back's output stay f32."""
    g, fetch, (pre, head) = _normed_products()
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    assert pre.id in half and pre.srcs[0].id not in half            # x + x W1: an add's
    assert head.id in half and head.srcs[0].id in half              # the view of x W3
    backs = [t for t in order if t.op == "rms_norm_back"]
    assert len(backs) == 2 and all(t.srcs[1].id in half and t.id not in half for t in backs)
    wgrads = [t for t in order if t.op == "rms_norm" and t.srcs[1].shape == t.shape]
    assert len(wgrads) == 2 and not any(t.id in half for t in wgrads)   # g (x r), summed


def test_norms_reading_and_writing_bf16_track_f32_storage(monkeypatch):
    stored, plain, half = _both_ways(_normed_products, monkeypatch)
    assert len(half) >= 6
    names = ("z", "dx", "dw", "dwh", "dw1", "dw2", "dw3", "dw4")
    for name, a, b in zip(names, stored, plain):
        assert rel_err(a, b) <= MIXED_TOL["bf16"], (name, rel_err(a, b))
    assert not np.array_equal(stored[0], plain[0])


def test_norms_between_products_match_numpy_at_bf16():
    from support.hostparity import compare_op

    def build(x, w1, w, w2):
        return ops.matmul(ops.rms_norm(ops.matmul(x, w1), 1e-5, weight=w), w2)
    compare_op(build, [(24, 32), (32, 48), (48,), (48, 16)], MIXED_TOL["bf16"],
               grad_tol=MIXED_TOL["bf16"], precision="bf16")


def _lora_step(path, targets):
    """A LoRA graph's loss and its adapters' gradients after one backward on fixed tokens."""
    g = lora_graph(path, targets=targets)
    rng = np.random.default_rng(0)
    n_vocab = g.find("token_embd.weight").shape[0]
    inputs = {g.find("tokens"): rng.integers(0, n_vocab, (2, 8)).astype(np.int32),
              g.find("positions"): np.tile(np.arange(8, dtype=np.int32), (2, 1)),
              g.find("labels"): rng.integers(0, n_vocab, 16).astype(np.int32)}
    fetch = [t for t in g.nodes if t.role == "state" and t.name.startswith("grad.")]
    return g, inputs, [g.outputs["forward"][0]] + fetch


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_lora_step_with_bf16_norms_tracks_f32_storage(family, tiny_llama, tmp_path,
                                                         monkeypatch):
    """Pre-norms (and Qwen3's q/k norms) reading and writing bf16: the loss and the
    adapters' gradients within bf16's rounding of the same step with every buffer f32."""
    from toygraph.fixtures.tiny_models import write_tiny_qwen3
    path = tiny_llama if family == "llama" else write_tiny_qwen3(tmp_path / "qwen3.gguf")
    from toygraph.models.model import GGUFModel
    g, inputs, fetch = _lora_step(path, ("q", "k", "v", "gate"))
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    n_layer, qk = GGUFModel(path).config.n_layer, 2 * (family == "qwen3")
    norms = [t for t in order if t.op == "rms_norm"]
    assert len(norms) == (2 + qk) * n_layer + 1        # pre-norms, q/k norms, the output norm
    assert all(t.id in half for t in norms)
    heads = [t for t in norms if t.ndim == 4]          # q/k norms: their projection's output
    assert len(heads) == qk * n_layer and all(t.srcs[0].id in half for t in heads)
    stored = run_phase(g, "cuda", inputs, "backward", fetch, "bf16")
    monkeypatch.setenv("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "0")
    plain = run_phase(g, "cuda", inputs, "backward", fetch, "bf16")
    for t, a, b in zip(fetch, stored, plain):
        assert rel_err(a, b) <= MIXED_TOL["bf16"], (t.name, rel_err(a, b))


#: One bf16 access of the norms' kernels made wrong (harmless with every buffer f32): the
#: storage-on run must then leave the f32-storage run's tolerance.
NORM_MUTATIONS = {
    "the normalized rows stored as f32 into a bf16 buffer": (
        "tg_stx(out, at + j, y, bf16);", "((float*)out)[at + j] = y;"),
    "rms_norm_back reads g with x's bf16 bit": (
        "float v = tg_ldx(g, at + j, bf16, 1);", "float v = tg_ldx(g, at + j, bf16, 0);"),
}


@pytest.mark.parametrize("mutation", one_by_default(NORM_MUTATIONS))
def test_a_wrong_bf16_access_in_the_norms_fails(mutation, monkeypatch):
    from toygraph.cuda import backend as cuda_backend
    from toygraph.ops.lowering import sources
    old, new = NORM_MUTATIONS[mutation]
    real = sources.backend_source("bf16")
    assert real.count(old) == 1, "the mutation no longer matches the kernel source"
    monkeypatch.setattr(cuda_backend, "backend_source",
                        lambda precision="bf16": real.replace(old, new))
    stored, plain, _ = _both_ways(_normed_products, monkeypatch)
    assert not all(rel_err(a, b) <= MIXED_TOL["bf16"] for a, b in zip(stored, plain))


# --- attention reading bf16 q, k, v and dO ---------------------------------------------------
def _attention_block(hd, seed=0, B=2, T=40, H=2, KV=1, D=32):
    """z = attention(x Wq, x Wk, x Wv) Wo, token-major (the decoder's layout): q, k, v and
    attention_back's dO are products, kept in bf16."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.param("x", rnd(rng, B * T, D))
    ws = [g.param(f"w{n}", rnd(rng, D, m * hd, s=0.3)) for n, m in (("q", H), ("k", KV),
                                                                     ("v", KV))]
    wo = g.param("wo", rnd(rng, H * hd, D, s=0.3))
    q, k, v = (ops.reshape(ops.matmul(x, w), (B, T, n, hd)) for w, n in zip(ws, (H, KV, KV)))
    o = ops.attention(q, k, v, scale=hd ** -0.5, causal=True, layout="bthd")
    z = g.output(ops.matmul(ops.reshape(o, (B * T, H * hd)), wo))
    loss = ops.sum(ops.mul(z, g.const("r", rnd(rng, B * T, D))))
    grads = accumulate_grads(backward(loss, [x, *ws, wo]))
    return g, [z] + [grads[p] for p in (x, *ws, wo)]


def _attention_reads(monkeypatch, forward, backward_):
    from dataclasses import replace
    monkeypatch.setitem(REGISTRY, "attention", replace(REGISTRY["attention"], bf16_reads=forward))
    monkeypatch.setitem(REGISTRY, "attention_back",
                        replace(REGISTRY["attention_back"], bf16_reads=backward_))


@pytest.mark.parametrize("hd", [64, 48])
def test_attention_reads_bf16_q_k_v_as_they_lie_and_changes_no_bit(hd, monkeypatch):
    """q, k and v made by products and kept in bf16: at hd == HD (64) the kernels read them
    where they lie, no tg_tca_to_bf16 (asis bits 0-2); at hd 48 the copies pad them from
    bf16. Either way the kernels get the values the copies of f32 q, k, v rounded to, so
    every output and gradient is the bits of the step with q, k, v f32 (dO kept f32 here:
    attention_back's bf16 read of dO is off)."""
    from toygraph.ops.lowering import dispatch
    _attention_reads(monkeypatch, (0, 1, 2), (0, 1, 2))
    g, fetch = _attention_block(hd)
    order, pinned, plan, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    atts = [t for t in order if t.op in ("attention", "attention_back")]
    assert len(atts) == 2 and all(t.srcs[j].id in half for t in atts for j in range(3))
    assert atts[1].srcs[-1].id not in half
    for t in atts:
        launches = dispatch.lower(t, lambda u: (u.id + 1) << 20, 1 << 40, frozenset(), "bf16",
                                  half)
        copies = [l for l in launches if l.kernel == "tg_tca_to_bf16"]
        assert len(copies) == (0 if hd == 64 else 3)
        assert all(int(l.args[-1][0]) == 1 for l in copies)        # read from bf16
        tca = [l for l in launches if l.kernel.startswith(("tg_tca_fwd", "tg_tca_bwd_d"))]
        assert tca and all(int(l.args[-1][0]) == (7 if hd == 64 else 0) for l in tca)
    stored = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    _attention_reads(monkeypatch, (), ())
    g2, fetch2 = _attention_block(hd)
    plain = run_phase(g2, "cuda", {}, "backward", fetch2, "bf16")
    for name, a, b in zip(("z", "dx", "dwq", "dwk", "dwv", "dwo"), stored, plain):
        assert np.array_equal(a, b), (name, float(np.abs(a - b).max()))


def test_attention_back_reading_bf16_do_tracks_the_f32_do(monkeypatch):
    """dO kept in bf16 too (the product dy Wo^T): the backward reads it where it lies
    (asis 15, the prep copies nothing) and D = rowsum(dO o) sums its rounded values, as
    dP = dO v^T does. The forward is the same bits; the gradients within bf16's tolerance
    of the step with dO f32, and not equal to it (D differs)."""
    from toygraph.ops.lowering import dispatch
    g, fetch = _attention_block(64)
    order, pinned, _, _ = training_plan(g)
    half = plan_bf16(order, pinned, "bf16")
    back = [t for t in order if t.op == "attention_back"][0]
    assert back.srcs[-1].id in half
    launches = dispatch.lower(back, lambda u: (u.id + 1) << 20, 1 << 40, frozenset(), "bf16",
                              half)
    assert [l.kernel for l in launches] == ["tg_tca_bwd_prep", "tg_tca_bwd_dkdv_64",
                                            "tg_tca_bwd_dq_64"]
    assert int(launches[0].args[0][0]) == 0 and int(launches[0].args[-1][0]) == 2
    assert all(int(l.args[-1][0]) == 15 for l in launches[1:])
    stored = run_phase(g, "cuda", {}, "backward", fetch, "bf16")
    _attention_reads(monkeypatch, (0, 1, 2), (0, 1, 2))
    g2, fetch2 = _attention_block(64)
    plain = run_phase(g2, "cuda", {}, "backward", fetch2, "bf16")
    assert np.array_equal(stored[0], plain[0])
    for name, a, b in zip(("dx", "dwq", "dwk", "dwv", "dwo"), stored[1:], plain[1:]):
        assert rel_err(a, b) <= MIXED_TOL["bf16"], (name, rel_err(a, b))
    assert not np.array_equal(stored[1], plain[1])
