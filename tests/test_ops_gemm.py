"""matmul (ops/gemm.py), f32 and block-format weights: f64 finite-difference gradients
(batched, broadcast, transposed, grouped-query), and the CUDA launches replayed in numpy:
tg_matmul's batch walks, and the fused kernels that read a weight (or a get_rows table)
in each GGUF block format against numpy on the dequantized weight."""
import numpy as np
import pytest

from support.cudaemu import (BLOCK_FORMATS, block_weight_const, check_lowering, const_node,
                     emulate_quant, needs_nvrtc)
from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from toygraph.core import ops
from toygraph.gguf import blocks
from toygraph.cuda.lowering import dispatch
from toygraph.core.ops.gemm import DEQUANT_KERNELS, QUANT_KERNELS
from toygraph.cuda.lowering.sources import module_source
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from toygraph.core.ops import KERNELS as CPU_KERNELS


@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((3, 4), (4, 5), False, False), ((3, 4), (5, 4), False, True),
    ((4, 3), (4, 5), True, False), ((4, 3), (5, 4), True, True),
    ((2, 3, 4), (4, 5), False, False), ((2, 3, 4), (5, 4), False, True),
    ((2, 3, 3, 4), (2, 3, 4, 5), False, False),          # batched heads
    ((2, 6, 3, 4), (2, 2, 3, 4), False, True),           # grouped-query: 6 q heads, 2 kv
    ((2, 6, 3, 3), (2, 2, 3, 4), False, False),          # attention-weights @ V, grouped
])
def test_matmul_gradients(sa, sb, ta, tb):
    rng = np.random.default_rng(3)
    g = Graph()
    a, b = g.param("a", rnd(rng, *sa)), g.param("b", rnd(rng, *sb))
    y = ops.matmul(a, b, trans_a=ta, trans_b=tb)
    assert check_gradients(g, weighted_sum(y, rng), [a, b], {}) <= TOL


def test_grouped_matmul_matches_repeated_heads():
    rng = np.random.default_rng(4)
    q, k = rnd(rng, 2, 6, 3, 4), rnd(rng, 2, 2, 3, 4)
    g = Graph()
    y = g.output(ops.matmul(g.const("q", q), g.const("k", k), trans_b=True))
    s = Session(g); s.realize(); s.run("forward")
    ref = q @ np.repeat(k, 3, axis=1).swapaxes(-1, -2)
    np.testing.assert_allclose(s.download(y), ref, rtol=1e-6)


@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((3, 4), (4, 5), False, False), ((3, 4), (5, 4), False, True),
    ((4, 3), (4, 5), True, False), ((4, 3), (5, 4), True, True),
    ((2, 3, 4), (4, 5), False, False), ((2, 3, 4), (5, 4), False, True),
    ((2, 3, 3, 4), (2, 3, 4, 5), False, False),
    ((2, 6, 3, 4), (2, 2, 3, 4), False, True),
    ((2, 6, 3, 3), (2, 2, 3, 4), False, False),
    ((2, 6, 4, 3), (2, 2, 4, 5), True, False),
    ((1, 3, 4), (2, 4, 5), False, False),
    ((2, 8, 3, 4), (1, 2, 4, 5), False, False),
])
def test_lowering_matmul_batches_match_numpy(sa, sb, ta, tb):
    node, vals = const_node(lambda a, b: ops.matmul(a, b, trans_a=ta, trans_b=tb), sa, sb)
    check_lowering(node, vals)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_quantized_matmul_kernels_compile_for_every_format(arch, cache):
    from toygraph.cuda.nvrtc import compile_cubin
    cubin = compile_cubin(module_source(("matmul.cu", "dequant.cu", "qmatmul.cu", "rows.cu")),
                          arch=arch,
                          name="qmatmul.cu")
    assert cubin[:4] == b"\x7fELF"
    for fmt in BLOCK_FORMATS:
        for name in [DEQUANT_KERNELS[fmt], *QUANT_KERNELS[fmt].values()]:
            assert name.encode() in cubin, name


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("build", ["forward", "backward", "forward3d", "get_rows"])
def test_quantized_lowering_matches_numpy_on_the_dequantized_weight(fmt, build):
    rng = np.random.default_rng(7)
    g, w, raw, wv = block_weight_const(rng, fmt, 67, 512)
    rows, cols = w.shape
    if build == "forward":
        xv = rng.normal(size=(70, cols))
        node = ops.matmul(g.const("x", xv), w, trans_b=True)
    elif build == "forward3d":   # [B, T, K] @ W^T: batch axes fold into M
        xv = rng.normal(size=(2, 35, cols))
        node = ops.matmul(g.const("x", xv), w, trans_b=True)
    elif build == "backward":    # dX = dY @ W
        xv = rng.normal(size=(2, 33, rows))
        node = ops.matmul(g.const("x", xv), w)
    else:
        xv = rng.integers(0, rows, size=(3, 11)).astype(np.int32)
        node = ops.get_rows(w, g.input("ids", (3, 11), "i32"))
    x = node.srcs[1] if build == "get_rows" else node.srcs[0]
    addr = {w.id: 1 << 24, x.id: 2 << 24, node.id: 3 << 24}
    mem = {addr[w.id]: blocks.as_bytes(raw), addr[x.id]: np.asarray(xv).ravel(),
           addr[node.id]: np.zeros(node.size)}
    launches = dispatch.lower(node, lambda t: addr[t.id], raw_consts={w.id})
    assert [l.kernel for l in launches] == [QUANT_KERNELS[fmt][
        {"forward": "nt", "forward3d": "nt", "backward": "nn", "get_rows": "rows"}[build]]]
    for launch in launches:
        assert all(isinstance(v, np.ndarray) and v.dtype in (np.int32, np.uint64)
                   for v in launch.args)
        M = int(launch.args[3][0]) if build != "get_rows" else 0
        assert launch.grid[1] == max(1, (M + 63) // 64) or build == "get_rows"
        emulate_quant(launch, mem, rows)
    want = np.zeros(node.shape)
    srcs = [wv.astype(np.float64), xv] if build == "get_rows" else [xv, wv.astype(np.float64)]
    CPU_KERNELS[node.op](want, srcs, node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)
