"""The mixed-precision matmuls (ops/gemm/, tc_layout.cuh + tc_matmul.cu): the kernels'
index math compiled for the host and replayed per lane and register through the mma
emulator of tests/support/mmaemu.py, so a wrong (lane, register) -> (row, col) mapping
shows up as a wrong matmul; the tiling's coverage and bank conflicts; whole launches (dense and
block-format) against numpy on rounded inputs; the kernel table, the compiled module's
register use, and that bf16/tf32 change only the matmuls' dispatch."""
import numpy as np
import pytest

from support.cudaemu import (BLOCK_FORMATS, block_weight_const, host_library, lora_graph, needs_nvrtc,
                     training_plan)
from support.mmaemu import (MMA_K, ROUND, emulate_tc_launch, kernel_frags, mma_emulate, round_bf16,
                    round_tf32)
from toygraph import ops
from toygraph.cuda import devmem
from toygraph.ops.lowering import dispatch
from support.kernelsrc import FAMILIES, KERNEL_NAMES, TC_KERNEL_NAMES
from toygraph.ops.gemm.cuda import BF16_GEMM_KERNELS, TC_KERNELS
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS
from toygraph.precision import TENSOR_CORE_PRECISIONS as TC_PRECISIONS
from toygraph.ops.lowering.sources import backend_source, module_source
from toygraph.errors import CudaError
from toygraph.core.graph import Graph
from toygraph.ops import KERNELS as CPU_KERNELS
from toygraph.ops.gemm import cuda as matmul_ops
from support.ptxas import ARCHS  # noqa: E402


_TC_HOST_DRIVER = r"""
extern "C" void tc_frag(int which, int lane, int r, int* x, int* y) {
    switch (which) {
        case 0: tg_bf16_a_frag(lane, r, *x, *y); break;
        case 1: tg_bf16_b_frag(lane, r, *x, *y); break;
        case 2: tg_tf32_a_frag(lane, r, *x, *y); break;
        case 3: tg_tf32_b_frag(lane, r, *x, *y); break;
        default: tg_tc_c_frag(lane, r, *x, *y); break;
    }
}
extern "C" void tc_stage(int n, int bk, int rows, int kfast, int* row, int* k) {
    for (int i = 0; i < n; ++i) tg_tc_stage_coord(i, bk, rows, kfast, row[i], k[i]);
}
extern "C" void tc_warp(int w, int* wm, int* wn) { tg_tc_warp_origin(w, *wm, *wn); }
extern "C" void tc_consts(int* c) {
    int v[] = {TC_BM, TC_BN, TC_THREADS, TC_WM, TC_WN, TC_MI, TC_NI,
               TC_BF16_BK, TC_BF16_LD, TC_TF32_BK, TC_TF32_LD};
    for (int i = 0; i < 11; ++i) c[i] = v[i];
}
"""


@pytest.fixture(scope="module")
def tc_layout(tmp_path_factory):
    """tc_layout.cuh compiled for the host: the kernels' own index functions as tables."""
    import ctypes
    from toygraph.ops.lowering.constants import constant_defines
    from toygraph.ops.lowering.sources import read_source
    so = host_library(tmp_path_factory, "tc_layout",
                      "#define __device__\n#define __forceinline__ inline\n"
                      + constant_defines() + read_source("tc_layout.cuh") + _TC_HOST_DRIVER)
    c = (ctypes.c_int * 11)()
    so.tc_consts(c)
    names = ["BM", "BN", "THREADS", "WM", "WN", "MI", "NI", "BF16_BK", "BF16_LD", "TF32_BK",
             "TF32_LD"]
    L = dict(zip(names, list(c)))
    x, y = ctypes.c_int(), ctypes.c_int()

    def frag(which, nregs):
        out = np.zeros((32, nregs, 2), np.int64)
        for lane in range(32):
            for r in range(nregs):
                so.tc_frag(which, lane, r, ctypes.byref(x), ctypes.byref(y))
                out[lane, r] = x.value, y.value
        return out

    L["frag"] = {"bf16": (frag(0, 4), frag(1, 2)), "tf32": (frag(2, 4), frag(3, 2))}
    L["cfrag"] = frag(4, 4)
    L["warps"] = []
    for w in range(L["THREADS"] // 32):
        so.tc_warp(w, ctypes.byref(x), ctypes.byref(y))
        L["warps"].append((x.value, y.value))

    def stage(bk, rows, kfast):
        n = bk * rows
        r, k = np.zeros(n, np.int32), np.zeros(n, np.int32)
        so.tc_stage(n, bk, rows, int(kfast), r.ctypes.data_as(ctypes.POINTER(ctypes.c_int)),
                    k.ctypes.data_as(ctypes.POINTER(ctypes.c_int)))
        return r.astype(np.int64), k.astype(np.int64)

    L["stage"] = stage
    L["bk"] = {"bf16": L["BF16_BK"], "tf32": L["TF32_BK"]}
    L["ld"] = {"bf16": L["BF16_LD"], "tf32": L["TF32_LD"]}
    L["kstep"] = {"bf16": 16, "tf32": 8}
    L["pair"] = {"bf16": 2, "tf32": 1}   # elements per 32-bit register
    return L


@pytest.mark.parametrize("prec", TC_PRECISIONS)
def test_tc_fragment_loads_and_stores_reproduce_one_mma_tile(prec, tc_layout):
    """A single 16 x 8 x K mma: the kernel's per-lane loads from [rows][k] shared tiles,
    the documented mma, and the kernel's per-lane stores give A @ B exactly."""
    L = tc_layout
    rng = np.random.default_rng(0)
    K, ld = MMA_K[prec], L["ld"][prec]
    A, B = rng.normal(size=(16, K)), rng.normal(size=(K, 8))
    As, Bs = np.zeros(16 * ld), np.zeros(8 * ld)
    As.reshape(16, ld)[:, :K] = A
    Bs.reshape(8, ld)[:, :K] = B.T          # B staged n-major: Bs[n][k]
    a, b, _, _ = kernel_frags(L, prec, As, Bs, ld, 0, 0, 0)
    d = mma_emulate(prec, a, b, np.zeros((32, 4)))
    C = np.full((16, 8), np.nan)
    for lane in range(32):
        for r in range(4):
            row, col = L["cfrag"][lane, r]
            assert np.isnan(C[row, col])
            C[row, col] = d[lane, r]
    np.testing.assert_allclose(C, A @ B, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("prec", TC_PRECISIONS)
def test_tc_tiling_covers_the_block_and_fragment_loads_are_bank_conflict_free(prec, tc_layout):
    L = tc_layout
    bk, ld, ks = L["bk"][prec], L["ld"][prec], L["kstep"][prec]
    assert L["BM"] == L["BN"] == matmul_ops.TC_TILE
    assert L["MI"] * 16 == L["WM"] and L["NI"] * 8 == L["WN"] and bk % ks == 0 and ld >= bk
    cover = np.zeros((L["BM"], L["BN"]), int)
    for wm, wn in L["warps"]:
        cover[wm:wm + L["WM"], wn:wn + L["WN"]] += 1
    assert (cover == 1).all()
    for rows in (L["BM"], L["BN"]):
        assert rows * bk % L["THREADS"] == 0
        for kfast in (0, 1):   # every (row, k) of a staged tile written exactly once
            r, k = L["stage"](bk, rows, kfast)
            assert ((0 <= r) & (r < rows) & (0 <= k) & (k < bk)).all()
            assert len(set(zip(r.tolist(), k.tolist()))) == rows * bk
            # consecutive threads walk the contiguous axis (runs of min(32, extent) lanes
            # of consecutive elements): coalesced global loads
            run = min(32, bk if kfast else rows)
            fast, slow = (k, r) if kfast else (r, k)
            for lane0 in range(0, 32, run):
                lanes = np.arange(lane0, lane0 + run)
                assert (np.diff(fast[lanes]) == 1).all() and len(set(slow[lanes])) == 1
    # shared-memory words of one fragment register across the warp: 32 distinct banks,
    # and bf16 pairs start on a 32-bit boundary
    pair = L["pair"][prec]
    tile = np.arange(L["BM"] * ld, dtype=np.float64)
    for kk in range(0, bk, ks):
        _, _, ia, ib = kernel_frags(L, prec, tile, tile, ld, 16, 8, kk)
        for idx in (ia, ib):
            assert (idx[:, :, 0] % pair == 0).all()
            words = idx[:, :, 0] // pair
            for r in range(words.shape[1]):
                assert len(set((words[:, r] % 32).tolist())) == 32


def _matmul_of_rounded(prec, node, a, b):
    """numpy's f64 matmul of ``a`` and ``b`` rounded to ``prec`` (as the kernels stage them)."""
    want = np.zeros(node.shape)
    rnd = ROUND[prec]
    CPU_KERNELS["matmul"](want, [rnd(a).astype(np.float64), rnd(b).astype(np.float64)],
                          node.attrs)
    return want


@pytest.mark.parametrize("prec", TC_PRECISIONS)
@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((150, 45), (45, 70), False, False),           # M, N, K off the 128 / 32 / 16 tiles
    ((45, 150), (70, 45), True, True),
    ((3, 20, 37), (37, 130), False, False),        # batch folded... and N over one tile
    ((2, 3, 17, 24), (2, 3, 24, 9), False, False),
    ((2, 4, 9, 16), (2, 2, 9, 16), False, True),   # grouped-query scores
    ((2, 4, 9, 9), (2, 2, 9, 16), False, False),   # grouped-query weights @ V
    ((33, 5), (33, 12), True, False),
])
def test_tc_matmul_replayed_through_the_mma_emulator_matches_numpy(prec, sa, sb, ta, tb,
                                                                   tc_layout):
    rng = np.random.default_rng(1)
    g = Graph()
    xv, yv = rng.normal(size=sa).astype(np.float32), rng.normal(size=sb).astype(np.float32)
    node = ops.matmul(g.const("x", xv), g.const("y", yv), trans_a=ta, trans_b=tb)
    addr = {t.id: (i + 1) << 24 for i, t in enumerate([*node.srcs, node])}
    mem = {addr[node.srcs[0].id]: xv.astype(np.float64).ravel(),
           addr[node.srcs[1].id]: yv.astype(np.float64).ravel(),
           addr[node.id]: np.full(node.size, np.nan)}
    launches = dispatch.lower(node, lambda t: addr[t.id], precision=prec)
    if prec == "bf16" and "tg_tcg_gemm_bf16" in [l.kernel for l in launches]:
        # the cost model picked tc_gemm.cu (tests/cuda/test_cuda_tc_gemm.py); replay the direct
        # kernel it would otherwise run
        launches = [matmul_ops._matmul(node, addr[node.id], lambda t: addr[t.id],
                                       tile=matmul_ops.TC_TILE, kernel=TC_KERNELS[prec]["matmul"],
                                       threads=256)]
    assert [l.kernel for l in launches] == [TC_KERNELS[prec]["matmul"]]
    emulate_tc_launch(tc_layout, launches[0], mem)
    got = mem[addr[node.id]].reshape(node.shape)
    # exactly the matmul of the rounded inputs (f64 sums here) ...
    np.testing.assert_allclose(got, _matmul_of_rounded(prec, node, xv, yv), rtol=1e-12,
                               atol=1e-12)
    # ... which is within the mixed-precision tolerance of the f32 result
    ref = np.zeros(node.shape)
    CPU_KERNELS["matmul"](ref, [xv.astype(np.float64), yv.astype(np.float64)], node.attrs)
    tol = {"bf16": 2e-2, "tf32": 5e-3}[prec]
    assert np.abs(got - ref).max() / np.abs(ref).max() <= tol


@pytest.mark.parametrize("prec", TC_PRECISIONS)
@pytest.mark.parametrize("fmt,build", [("q4_k", "forward"), ("q8_0", "backward"),
                                       ("bf16", "forward3d"), ("q3_k", "backward"),
                                       ("iq4_xs", "backward"), ("q5_0", "forward")])
def test_tc_quantized_matmul_replayed_through_the_mma_emulator(prec, fmt, build, tc_layout):
    rng = np.random.default_rng(5)
    g, w, _, wv = block_weight_const(rng, fmt, 70, 256)
    rows, cols = w.shape
    if build == "backward":
        xv = rng.normal(size=(2, 20, rows)).astype(np.float32)
        node = ops.matmul(g.const("x", xv), w)
    else:
        xv = rng.normal(size=(130, cols) if build == "forward" else (2, 9, cols))
        xv = xv.astype(np.float32)
        node = ops.matmul(g.const("x", xv), w, trans_b=True)
    addr = {w.id: 1 << 24, node.srcs[0].id: 2 << 24, node.id: 3 << 24}
    mem = {addr[node.srcs[0].id]: xv.astype(np.float64).ravel(),
           addr[node.id]: np.full(node.size, np.nan)}
    launches = dispatch.lower(node, lambda t: addr[t.id], raw_consts={w.id}, precision=prec)
    kind = "nn" if build == "backward" else "nt"
    assert [l.kernel for l in launches] == [FORMAT_KERNELS[TC_KERNELS[prec][kind]][fmt]]
    q = dispatch.lower(node, lambda t: addr[t.id], raw_consts={w.id})[0]  # the f32 kernel's
    assert [a.tolist() for a in launches[0].args] == [a.tolist() for a in q.args]
    emulate_tc_launch(tc_layout, launches[0], mem, raw=wv.astype(np.float64))
    got = mem[addr[node.id]].reshape(node.shape)
    np.testing.assert_allclose(got, _matmul_of_rounded(prec, node, xv, wv), rtol=1e-12,
                               atol=1e-12)


def test_rounding_emulators_match_numpy_and_known_values():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9, -(1 + 2 ** -8), 3.14159], np.float32)
    # bf16 keeps 7 mantissa bits: 1 + 2^-8 is a tie -> even (1.0); 1 + 3*2^-9 rounds up
    np.testing.assert_array_equal(round_bf16(x)[:4], [1.0, 1.0, 1 + 2 ** -7, -1.0])
    # tf32 keeps 10: ties away from zero
    t = np.array([1 + 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -12], np.float32)
    np.testing.assert_array_equal(round_tf32(t), [1 + 2 ** -10, -(1 + 2 ** -10), 1.0])
    r = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert np.abs(round_bf16(r) - r).max() <= np.abs(r).max() * 2 ** -8
    assert np.abs(round_tf32(r) - r).max() <= np.abs(r).max() * 2 ** -11


# --- the tc kernel table, the module it is compiled into, and the f32 path left alone ----------
def test_tc_kernel_table_and_the_f32_module_is_unchanged():
    assert backend_source("f32") == module_source(FAMILIES)
    assert set(TC_PRECISIONS) == set(TC_KERNELS) == {"bf16", "tf32"}
    names = set()
    for prec, table in TC_KERNELS.items():
        names.add(table["matmul"])
        for kind in ("nt", "nn"):
            assert tuple(FORMAT_KERNELS[table[kind]]) == BLOCK_FORMATS
            names |= set(FORMAT_KERNELS[table[kind]].values())
    attention = {n for n in TC_KERNEL_NAMES if n.startswith("tg_tca_")}   # tc_attention.cu
    assert set(BF16_GEMM_KERNELS) == {n for n in TC_KERNEL_NAMES if n.startswith("tg_tcg_")}
    names |= set(BF16_GEMM_KERNELS)                                          # tc_gemm.cu
    assert names == set(TC_KERNEL_NAMES) - attention
    assert not (names | attention) & set(KERNEL_NAMES)   # the f32 module has none of them
    assert set(kernel_names_of(backend_source("bf16"))) == set(KERNEL_NAMES) | set(TC_KERNEL_NAMES)


def kernel_names_of(src):
    from toygraph.ops.lowering.sources import kernel_names
    return kernel_names(src)


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_tc_module_compiles_without_spills(arch):
    """Every tensor-core kernel compiles for sm_80 and sm_90 (inline-PTX mma.sync, cvt to
    bf16/tf32) into the mixed-precision module, and ptxas reports no stack frame or spills
    in the matmuls (register arrays indexed only by unrolled constants; 64 f32
    accumulators per thread). The attention kernels' report: tests/cuda/test_cuda_tc_attention.py;
    the bf16 GEMM's: tests/cuda/test_cuda_tc_gemm.py."""
    from support.ptxas import bf16_module
    cubin, report = bf16_module(arch)
    assert cubin[:4] == b"\x7fELF"
    for name in (*KERNEL_NAMES, *TC_KERNEL_NAMES):
        assert name.encode() in cubin, name
    assert set(report) >= set(KERNEL_NAMES) | set(TC_KERNEL_NAMES)   # ptxas saw every kernel
    tc_matmul = {n for n in TC_KERNEL_NAMES if not n.startswith(("tg_tca_", "tg_tcg_"))}
    usage = {n: u for n, u in report.items() if n in tc_matmul}
    assert usage and set(usage) == tc_matmul
    for name, u in usage.items():
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
        assert 0 < u["registers"] <= 255, (name, u)
        assert 0 < u["smem"] <= 48 * 1024, (name, u)   # static limit, no opt-in needed


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_llama_kquant"])
@pytest.mark.parametrize("prec", TC_PRECISIONS)
def test_mixed_precision_lowering_changes_only_the_matmuls(model, prec, request):
    """bf16/tf32 swap each matmul (and matmul_add's product) for its tensor-core kernel with
    the same arguments (bf16:
    a dense matmul for tc_gemm.cu's copies, GEMM and split sum, and the attention for
    tc_attention.cu's kernels); every other launch, and the whole f32 lowering, is
    identical to the default."""
    g = lora_graph(request.getfixturevalue(model), targets=("q", "k", "v", "o", "gate"))
    order, pinned, plan, outputs = training_plan(g)
    raw = frozenset(devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
                    .raw_consts)
    addr = {t.id: (i + 1) << 20 for i, t in enumerate(order)}
    seen = 0
    for node in order:
        if node.op is None:
            continue
        args = (node, lambda t: addr[t.id], 1 << 40, raw)
        base = dispatch.lower(*args)
        same = dispatch.lower(*args, precision="f32")
        tc = dispatch.lower(*args, precision=prec)
        assert [(l.kernel, l.grid, l.block, [a.tolist() for a in l.args]) for l in base] == \
               [(l.kernel, l.grid, l.block, [a.tolist() for a in l.args]) for l in same]
        if node.op.startswith("attention") and prec == "bf16":
            assert all(l.kernel.startswith("tg_tca_") or l.kernel == "tg_attn_bwd_sinks"
                       for l in tc)
            continue
        if node.op not in ("matmul", "matmul_add"):
            assert [(l.kernel, l.grid, [a.tolist() for a in l.args]) for l in base] == \
                   [(l.kernel, l.grid, [a.tolist() for a in l.args]) for l in tc]
            continue
        seen += 1
        if any(l.kernel.startswith("tg_tcg_") for l in tc):  # bf16, tc_gemm.cu's pick
            assert [l.kernel for l in tc][-2:] in (["tg_tcg_to_bf16", "tg_tcg_gemm_bf16"],
                                                   ["tg_tcg_gemm_bf16", "tg_tcg_sum_splits"])
            assert {l.kernel for l in tc} <= set(BF16_GEMM_KERNELS)
            continue
        if base[0].kernel.startswith("tg_scale"):   # scale_a's prescale, the same launch
            assert [(l.kernel, [a.tolist() for a in l.args]) for l in base[:1]] == \
                   [(l.kernel, [a.tolist() for a in l.args]) for l in tc[:1]]
            base, tc = base[1:], tc[1:]
        if node.op == "matmul_add":   # the same epilogue after the product's kernel
            assert [(l.kernel, [a.tolist() for a in l.args]) for l in base[1:]] == \
                   [(l.kernel, [a.tolist() for a in l.args]) for l in tc[1:]]
            assert [l.kernel for l in tc[1:]] == ["tg_matmul_add_epilogue"]
            base, tc = base[:1], tc[:1]
        (b,), (t,) = base, tc
        assert t.kernel in TC_KERNEL_NAMES and t.kernel.endswith("_" + prec)
        assert [a.tolist() for a in b.args] == [a.tolist() for a in t.args]
        M, N = int(b.args[3][0]), int(b.args[4][0])
        assert t.grid[:2] == (-(-N // 128), -(-M // 128)) and t.grid[2] == b.grid[2]
    assert seen


def test_mixed_precision_is_cuda_only_and_validated():
    from toygraph.recipes import RecipeOptions
    from toygraph.cuda.backend import CudaBackend
    from toygraph.errors import GraphError
    from toygraph.core.session import Session
    for dt in ("bf16", "tf32"):
        RecipeOptions(precision=dt, backend="cuda")
        with pytest.raises(GraphError, match="needs the cuda backend"):
            RecipeOptions(precision=dt)
        with pytest.raises(GraphError, match=dt):
            Session(Graph(), backend="cpu", precision=dt)
        with pytest.raises(GraphError, match="dtype must be f32 or f64"):
            Session(Graph(), backend="cpu", dtype=dt)   # dtype is the buffers' type, not this
    with pytest.raises(GraphError, match="precision"):
        RecipeOptions(precision="f16", backend="cuda")
    with pytest.raises(CudaError, match="bf16"):   # names the choices, before any driver call
        CudaBackend("f16")
