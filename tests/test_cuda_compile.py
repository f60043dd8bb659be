"""CUDA without a GPU: every kernel compiles with NVRTC for sm_80 and sm_90, compile errors
carry NVRTC's log, the disk cache works, and the host-side lowering (strides for
broadcasting, permutes, grouped-query sharing, reductions, batched matmul) reproduces the
numpy kernels when its index arithmetic is replayed in numpy.

The NVRTC tests skip only when ``cuda.bindings.nvrtc`` cannot be imported; CI installs
the ``cuda`` extra, so there they run for real.
"""
import importlib

import numpy as np
import pytest

from toygraph import ops, quant
from toygraph.cpu.kernels import KERNELS as CPU_KERNELS
from toygraph.cuda import lower_fused, lowering
from toygraph.cuda.kernels import DEQUANT_KERNELS, KERNEL_NAMES, module_source
from toygraph.cuda.lowering import OP_KERNELS
from toygraph.errors import CudaError
from toygraph.graph import Graph


def _has_nvrtc() -> bool:
    try:
        importlib.import_module("cuda.bindings.nvrtc")
        return True
    except Exception:
        return False


needs_nvrtc = pytest.mark.skipif(not _has_nvrtc(), reason="cuda.bindings.nvrtc not importable")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path))
    return tmp_path / "kernels"   # nvrtc.py's cubins: $TOYGRAPH_CACHE/kernels


# --- the kernel table ------------------------------------------------------------------------
def test_every_op_and_storage_has_a_kernel():
    assert set(OP_KERNELS) == set(ops.OPS)
    for op, names in OP_KERNELS.items():
        for n in names:
            assert n in KERNEL_NAMES, f"{op}: kernel {n} missing from the sources"
    assert set(DEQUANT_KERNELS) == set(quant.BLOCK) - {"f32"}
    assert set(DEQUANT_KERNELS.values()) <= set(KERNEL_NAMES)


# --- NVRTC ---------------------------------------------------------------------------------------
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_whole_module_compiles(arch, cache):
    from toygraph.cuda.nvrtc import compile_cubin
    cubin = compile_cubin(module_source(), arch=arch)
    assert cubin[:4] == b"\x7fELF"
    for name in KERNEL_NAMES:  # every extern "C" kernel is a symbol of the cubin
        assert name.encode() in cubin, name


@needs_nvrtc
def test_compile_error_carries_the_log(cache):
    from toygraph.cuda.nvrtc import compile_cubin
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_thing; }'
    with pytest.raises(CudaError) as e:
        compile_cubin(bad, arch="sm_80", name="broken.cu")
    msg = str(e.value)
    assert "broken.cu" in msg and "undefined_thing" in msg and "sm_80" in msg


@needs_nvrtc
def test_disk_cache_returns_identical_bytes_without_recompiling(cache):
    from toygraph.cuda import nvrtc
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }'
    first = nvrtc.compile_cubin(src, arch="sm_80")
    compiled = nvrtc.compile_count
    assert len(list(cache.glob("*.cubin"))) == 1
    assert not list(cache.glob("*.tmp"))
    second = nvrtc.compile_cubin(src, arch="sm_80")
    assert second == first and nvrtc.compile_count == compiled
    nvrtc.compile_cubin(src, arch="sm_90")  # another arch is another entry
    assert nvrtc.compile_count == compiled + 1
    assert len(list(cache.glob("*.cubin"))) == 2


@needs_nvrtc
def test_bad_arch_is_a_clear_error(cache):
    from toygraph.cuda.nvrtc import compile_cubin
    with pytest.raises(CudaError, match="arch"):
        compile_cubin("", arch="volta")


def test_backend_imports_and_refuses_f64_without_touching_the_driver():
    from toygraph.cuda.backend import CudaBackend
    with pytest.raises(CudaError, match="f32"):
        CudaBackend("f64")


def test_backend_without_a_device_is_a_cuda_error():
    from toygraph.cuda import driver
    from toygraph.cuda.backend import CudaBackend
    if driver.available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(CudaError):
        CudaBackend("f32")


# --- lowering replayed in numpy ------------------------------------------------------------------
def _walk(packed, n):
    nd = int(packed[0])
    dims, sa, sb = packed[1:1 + nd], packed[9:9 + nd], packed[17:17 + nd]
    i = np.arange(n)
    oa, ob = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for d in reversed(range(nd)):
        q = i % dims[d]
        i = i // dims[d]
        oa += q * sa[d]
        ob += q * sb[d]
    return oa, ob


def _emulate(launch, mem):
    """Replay a launch's index arithmetic with numpy on flat arrays keyed by address."""
    k, a = launch.kernel, [x[0] if x.size == 1 else x for x in launch.args]
    if k in ("tg_binary", "tg_gather", "tg_copy"):
        out, n = mem[int(a[0])], int(a[3] if k == "tg_binary" else a[2])
        if k == "tg_copy":
            out[:] = mem[int(a[1])][:n]
        elif k == "tg_gather":
            out[:] = mem[int(a[1])][_walk(a[3], n)[0]]
        else:
            oa, ob = _walk(a[4], n)
            x, y = mem[int(a[1])][oa], mem[int(a[2])][ob]
            out[:] = [x + y, x - y, x * y][int(a[5])]
    elif k in ("tg_reduce_block", "tg_reduce_thread"):
        out, x, n_out, kept, red, n_red = mem[int(a[0])], mem[int(a[1])], *a[2:]
        base, roff = _walk(kept, int(n_out))[0], _walk(red, int(n_red))[0]
        out[:] = x[base[:, None] + roff[None, :]].sum(axis=1)
    elif k == "tg_matmul":
        out, A, B = mem[int(a[0])], mem[int(a[1])], mem[int(a[2])]
        M, N, K, sam, sak, sbk, sbn, nbatch = (int(v) for v in a[3:11])
        oa, ob = _walk(a[11], nbatch)
        m, kk, nn = np.arange(M)[:, None], np.arange(K)[None, :], np.arange(N)[None, :]
        for z in range(nbatch):
            am = A[oa[z] + m * sam + kk * sak]
            bm = B[ob[z] + kk.T * sbk + nn * sbn]
            out[z * M * N:(z + 1) * M * N] = (am @ bm).ravel()
    else:
        raise AssertionError(f"no emulation for {k}")


def _check_lowering(node, srcs_values):
    mem, addr = {}, {}
    for t, v in zip(node.srcs, srcs_values):
        addr[t.id] = (t.id + 1) << 20
        mem[addr[t.id]] = np.asarray(v, np.float64).ravel()
    addr[node.id] = (node.id + 1) << 20
    mem[addr[node.id]] = np.zeros(node.size)
    for launch in lowering.lower(node, lambda t: addr[t.id]):
        for x in launch.args:
            assert isinstance(x, np.ndarray) and x.dtype in (np.int32, np.uint64, np.float32,
                                                             np.float64)
        _emulate(launch, mem)
    want = np.zeros(node.shape)
    CPU_KERNELS[node.op](want, [np.asarray(v, np.float64) for v in srcs_values], node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)


def _node(build, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    g = Graph()
    vals = [rng.normal(size=s) for s in shapes]
    leaves = [g.const(f"c{i}", v) for i, v in enumerate(vals)]
    return build(*leaves), vals


@pytest.mark.parametrize("build,shapes", [
    (ops.add, [(2, 3, 4), (4,)]), (ops.sub, [(3, 4), (1, 4)]), (ops.mul, [(2, 3, 4), (3, 1)]),
    (ops.add, [(2, 1, 4), (3, 1)]), (ops.mul, [(5, 7), (5, 7)]),
    (lambda x: x.permute(2, 0, 1), [(2, 3, 4)]), (lambda x: x.permute(0, 2, 1, 3), [(2, 3, 4, 5)]),
    (lambda x: x.T, [(3, 5)]), (lambda x: x.reshape(4, 6), [(2, 3, 4)]),
    (lambda x: ops.expand(x, (3, 2, 4)), [(2, 1)]), (lambda x: ops.expand(x, (2, 6, 3)), [(2, 2, 3)]),
    (lambda x: ops.expand(x, (2, 3, 4)), [(1, 1, 4)]),
    (lambda x: ops.sum_to(x, (1, 4)), [(3, 4)]), (lambda x: ops.sum_to(x, (2, 2, 3)), [(2, 6, 3)]),
    (lambda x: ops.sum_to(x, (4,)), [(2, 3, 4)]), (lambda x: ops.sum_to(x, (3, 1)), [(2, 3, 200)]),
    (lambda x: ops.sum(x), [(3, 4)]), (lambda x: ops.sum(x, 1), [(3, 4, 2)]),
    (lambda x: ops.sum(x, 0), [(300, 2)]),
])
def test_lowering_walks_match_numpy(build, shapes):
    node, vals = _node(build, *shapes)
    _check_lowering(node, vals)


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
    node, vals = _node(lambda a, b: ops.matmul(a, b, trans_a=ta, trans_b=tb), sa, sb)
    _check_lowering(node, vals)


def test_collapse_merges_contiguous_and_broadcast_dims():
    dims, (sa, sb) = lowering.collapse([2, 3, 4], [12, 4, 1], [0, 0, 1])
    assert dims == [6, 4] and sa == [4, 1] and sb == [0, 1]
    dims, (sa,) = lowering.collapse([1, 5, 1], [5, 1, 1])
    assert dims == [5] and sa == [1]


def test_scalar_arguments_are_fixed_width():
    g = Graph()
    x = g.const("x", np.ones((4, 8)))
    for node in (ops.scale(x, 0.5), ops.rms_norm(x, 1e-5), ops.softmax(x, scale=2.0)):
        for launch in lowering.lower(node, lambda t: 1 << 20):
            assert all(isinstance(v, np.ndarray) and v.dtype.itemsize in (4, 8) for v in launch.args)


@needs_nvrtc
def test_compiling_leaves_shared_bytes_objects_alone(cache):
    """NVRTC writes its log and cubin into Python buffers; a 1-byte log once went into
    CPython's shared b" " and turned every space in the process into NUL."""
    from toygraph.cuda.nvrtc import compile_cubin
    compile_cubin('extern "C" __global__ void k() {}', arch="sm_80", name="tiny.cu")
    assert b" "[0] == 32 and " ".encode()[0] == 32


# --- frozen consts kept in block format: fused quantized matmul / get_rows -----------------------
from toygraph.cuda import devmem  # noqa: E402
from toygraph.cuda.kernels import QUANT_KERNELS, layout_defines  # noqa: E402
from toygraph.graph import PHASES, topo_order  # noqa: E402
from toygraph.memory import plan_buffers  # noqa: E402

BLOCK_FORMATS = sorted(set(quant.BLOCK) - {"f32"})


def test_quant_kernel_table_covers_every_block_format():
    assert set(QUANT_KERNELS) == set(BLOCK_FORMATS) == set(lowering.BLOCK_STORAGE)
    for fmt, names in QUANT_KERNELS.items():
        assert set(names) == {"nt", "nn", "rows"}
        for n in names.values():
            assert n in KERNEL_NAMES, f"{fmt}: kernel {n} missing from the sources"


def test_kernels_take_block_layouts_from_quant_py():
    defines = layout_defines()
    for fmt in BLOCK_FORMATS:
        elems, size = quant.BLOCK[fmt]
        assert f"#define TG_{fmt.upper()}_QK {elems}\n" in defines
        assert f"#define TG_{fmt.upper()}_BYTES {size}\n" in defines
        for field, off in quant.LAYOUT.get(fmt, {}).items():
            assert f"#define TG_{fmt.upper()}_{field.upper()} {off}\n" in defines


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_quantized_matmul_kernels_compile_for_every_format(arch, cache):
    from toygraph.cuda.nvrtc import compile_cubin
    cubin = compile_cubin(module_source(("matmul.cu", "dequant.cu", "qmatmul.cu")), arch=arch,
                          name="qmatmul.cu")
    assert cubin[:4] == b"\x7fELF"
    for fmt in BLOCK_FORMATS:
        for name in [DEQUANT_KERNELS[fmt], *QUANT_KERNELS[fmt].values()]:
            assert name.encode() in cubin, name


def _qmm_format(kernel: str) -> tuple[str, str]:
    for fmt, names in QUANT_KERNELS.items():
        for kind, name in names.items():
            if name == kernel:
                return fmt, kind
    raise AssertionError(f"not a quantized kernel: {kernel}")


def _emulate_quant(launch, mem, raw_rows):
    """Replay a fused kernel's host-computed arguments in numpy: the block-format weight is
    decoded from its bytes with the row length ``row_bytes`` implies."""
    fmt, kind = _qmm_format(launch.kernel)
    a = [int(x[0]) for x in launch.args]
    elems, size = quant.BLOCK[fmt]
    if kind == "rows":
        out, table, ids, n, D, rb = a
        assert rb % size == 0 and rb // size * elems == D
        W = quant.dequantize(mem[table][:raw_rows * rb], fmt, (raw_rows, D))
        i = np.arange(n)
        mem[out][:n] = W[mem[ids].astype(np.int64)[i // D], i % D]
        return
    out, x, w, M, N, K, rb = a
    assert rb % size == 0
    cols = rb // size * elems
    W = quant.dequantize(mem[w][:raw_rows * rb], fmt, (raw_rows, cols)).astype(np.float64)
    B = W.T if kind == "nt" else W
    assert B.shape == (K, N)
    mem[out][:M * N] = (mem[x][:M * K].reshape(M, K) @ B).ravel()


def _qweight(rng, fmt, rows, cols):
    raw = quant.quantize(rng.normal(size=(rows, cols)).astype(np.float32), fmt)
    return raw, quant.dequantize(raw, fmt, (rows, cols))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("build", ["forward", "backward", "forward3d", "get_rows"])
def test_quantized_lowering_matches_numpy_on_the_dequantized_weight(fmt, build):
    rng = np.random.default_rng(7)
    elems = quant.BLOCK[fmt][0]
    rows, cols = 67, max(2 * elems, 96) if elems < 256 else 512
    raw, wv = _qweight(rng, fmt, rows, cols)
    g = Graph()
    w = g.const("w", raw, shape=(rows, cols), storage=fmt)
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
    mem = {addr[w.id]: quant._as_bytes(raw), addr[x.id]: np.asarray(xv).ravel(),
           addr[node.id]: np.zeros(node.size)}
    launches = lowering.lower(node, lambda t: addr[t.id], raw_consts={w.id})
    assert [l.kernel for l in launches] == [QUANT_KERNELS[fmt][
        {"forward": "nt", "forward3d": "nt", "backward": "nn", "get_rows": "rows"}[build]]]
    for launch in launches:
        assert all(isinstance(v, np.ndarray) and v.dtype in (np.int32, np.uint64)
                   for v in launch.args)
        M = int(launch.args[3][0]) if build != "get_rows" else 0
        assert launch.grid[1] == max(1, (M + 63) // 64) or build == "get_rows"
        _emulate_quant(launch, mem, rows)
    want = np.zeros(node.shape)
    srcs = [wv.astype(np.float64), xv] if build == "get_rows" else [xv, wv.astype(np.float64)]
    CPU_KERNELS[node.op](want, srcs, node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)


def test_lowering_refuses_a_block_format_const_where_no_fused_kernel_reads_it():
    rng = np.random.default_rng(0)
    raw, _ = _qweight(rng, "q8_0", 64, 64)
    g = Graph()
    w = g.const("w", raw, shape=(64, 64), storage="q8_0")
    x = g.const("x", np.ones((64, 64)))
    for node, i in [(ops.matmul(w, x), 0), (ops.matmul(x, w, trans_a=True), 1),
                    (ops.contiguous(w), 0), (ops.matmul(w, w, trans_b=True), 1)]:
        assert not lowering.reads_block_format(node, i)
        with pytest.raises(CudaError, match="block format"):
            lowering.lower(node, lambda t: 1 << 20, raw_consts={w.id})
    assert lowering.reads_block_format(ops.matmul(x, w), 1)
    assert not lowering.reads_block_format(ops.matmul(x, x), 1)  # f32 storage


def _training_plan(graph):
    """Session.realize's schedule, pins and buffer plan, without a backend."""
    done, order = set(), []
    for phase in PHASES:
        order = order + topo_order(graph.outputs[phase] + graph.effects[phase], done)
        done = {t.id for t in order}
    pinned = {t.id for t in order if t.role is not None}
    pinned |= {t.id for p in PHASES for t in graph.outputs[p]}
    outputs = [t for ts in graph.outputs.values() for t in ts]
    return order, pinned, plan_buffers(order, pinned, 4), outputs


def _lora_graph(path, targets=("q", "v")):
    from toygraph.gguf import GGUFModel
    from toygraph.models.llama import LoraConfig, build_llama
    from toygraph.optim import build_training
    model = GGUFModel(path)
    g = Graph()
    net = build_llama(g, model.config, batch=2, seq_len=8, model=model,
                      lora=LoraConfig(targets=targets, rank=4, alpha=8))
    lab = g.input("labels", (16,), "i32")
    loss = g.output(ops.cross_entropy(net.logits, lab, reduction="sum"))
    build_training(loss, net.params, count=g.output(ops.count_valid(lab)), max_norm=1.0)
    return g


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_llama_kquant"])
def test_realize_plan_keeps_frozen_weights_in_block_format(model, request):
    g = _lora_graph(request.getfixturevalue(model), targets=("q", "k", "v", "o", "gate"))
    order, pinned, plan, outputs = _training_plan(g)
    consts = [t for t in order if t.role == "const" and t.storage != "f32"]
    assert consts
    mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
    old = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=False)
    for t in consts:  # every quantized const is only read by matmul / get_rows
        assert t.id not in mem.f32_buffers, t.name
        assert mem.raw_consts[t.id] == quant.nbytes(t.storage, t.shape)
        assert old.f32_buffers[t.id] == 4 * t.size and t.id not in old.raw_consts
    assert set(mem.f32_buffers) | set(mem.raw_consts) == set(old.f32_buffers)
    assert mem.dequant_temp_bytes == 0 < old.dequant_temp_bytes
    saved = sum(4 * t.size - quant.nbytes(t.storage, t.shape) for t in consts)
    assert mem.saved_bytes == saved == old.resident_bytes - mem.resident_bytes > 0
    assert mem.report()["saved_bytes"] == saved and old.report()["saved_bytes"] == 0
    # every node lowers, and the ones reading a block-format const use a fused kernel
    fused = {n for names in QUANT_KERNELS.values() for n in names.values()}
    addr = {t.id: (i + 1) << 20 for i, t in enumerate(order)}
    for node in order:
        if node.op is None:
            continue
        kernels = [l.kernel for l in lowering.lower(node, lambda t: addr[t.id], 1 << 40,
                                                    frozenset(mem.raw_consts))]
        if any(s.id in mem.raw_consts for s in node.srcs):
            assert kernels and set(kernels) <= fused, (node.op, kernels)
        else:
            assert not set(kernels) & fused


def test_plan_keeps_f32_copies_where_a_consumer_needs_them(monkeypatch):
    rng = np.random.default_rng(1)
    raw, _ = _qweight(rng, "q4_0", 32, 64)
    g = Graph()
    x = g.input("x", (5, 64))
    shared = g.const("shared", raw, shape=(32, 64), storage="q4_0")  # also read by contiguous
    only_mm = g.const("only_mm", raw, shape=(32, 64), storage="q4_0")
    shown = g.const("shown", raw, shape=(32, 64), storage="q4_0")    # a graph output
    g.output(ops.matmul(x, shared, trans_b=True) + ops.matmul(x, only_mm, trans_b=True))
    g.output(ops.contiguous(shared))
    g.output(shown)
    g.output(ops.matmul(x, shown, trans_b=True))
    order, pinned, plan, outputs = _training_plan(g)
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
    g = _lora_graph(smollm2)
    order, pinned, plan, outputs = _training_plan(g)
    mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
    assert len(mem.raw_consts) == 211          # 30 layers x 7 matrices + token_embd
    assert sum(mem.raw_consts.values()) == 96_436_224
    assert mem.f32_avoided_bytes == 537_919_488
    assert mem.saved_bytes == 441_483_264      # 421.0 MiB


# --- quant.cuh's decoders, compiled for the host and checked bit for bit against quant.py ----
_HOST_SHIM = r"""
#include <math.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
static float tg_keep(float v) { volatile float r = v; return r; }
static float __fmul_rn(float a, float b) { return tg_keep(a * b); }
static float __fadd_rn(float a, float b) { return tg_keep(a + b); }
static float __fsub_rn(float a, float b) { return tg_keep(a - b); }
static float tg_load_half(const unsigned char* p) {   // exact IEEE half -> float
    unsigned h = p[0] | (p[1] << 8), e = (h >> 10) & 31, m = h & 1023;
    float f = e == 0 ? ldexpf((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), (int)e - 25);
    return (h >> 15) ? -f : f;
}
static float tg_bf16_to_float(unsigned short h) {
    unsigned u = ((unsigned)h) << 16; float f; memcpy(&f, &u, 4); return f;
}
"""

_HOST_DRIVER = r"""
template <class F> static void run(const unsigned char* raw, long long n, int rows,
                                   int row_bytes, float* out) {
    long long cols = n / rows;   // decode through rows, as the fused kernels do
    for (long long e = 0; e < n; ++e)
        out[e] = tg_dequant_at<F>(raw + (e / cols) * row_bytes, e % cols);
}
extern "C" int decode(const char* fmt, const unsigned char* raw, long long n, int rows,
                      int row_bytes, float* out) {
#define TG_CASE(name, F) if (!strcmp(fmt, name)) { run<F>(raw, n, rows, row_bytes, out); return 0; }
    TG_CASE("f16", TgF16) TG_CASE("bf16", TgBF16) TG_CASE("q8_0", TgQ8_0)
    TG_CASE("q4_0", TgQ4_0) TG_CASE("q4_1", TgQ4_1) TG_CASE("q4_k", TgQ4_K)
    TG_CASE("q5_k", TgQ5_K) TG_CASE("q6_k", TgQ6_K) TG_CASE("q5_0", TgQ5_0)
    TG_CASE("q5_1", TgQ5_1) TG_CASE("iq4_nl", TgIQ4_NL) TG_CASE("q2_k", TgQ2_K)
    TG_CASE("q3_k", TgQ3_K) TG_CASE("iq4_xs", TgIQ4_XS)
    return 1;
}
"""


@pytest.fixture(scope="module")
def host_decoder(tmp_path_factory):
    import ctypes
    import shutil
    import subprocess
    from toygraph.cuda.kernels import read_source
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("hostdecode")
    src = d / "decode.cpp"
    src.write_text(_HOST_SHIM + layout_defines() + read_source("quant.cuh") + _HOST_DRIVER)
    lib = d / "decode.so"
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib),
                    str(src)], check=True, capture_output=True)
    fn = ctypes.CDLL(str(lib)).decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p]
    return fn


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_shared_decoders_match_quant_py_bit_for_bit(fmt, host_decoder):
    rng = np.random.default_rng(11)
    elems = quant.BLOCK[fmt][0]
    rows, cols = 5, 2 * max(elems, 32)
    x = (rng.normal(size=(rows, cols)) * rng.uniform(0.01, 3, size=(rows, 1))).astype(np.float32)
    raw = np.ascontiguousarray(quant.quantize(x, fmt)).reshape(-1).view(np.uint8)
    if fmt in ("f16", "bf16"):  # every finite bit pattern, subnormals and -0 included
        bits = np.arange(1 << 16, dtype=np.uint16)
        bits = bits[np.isfinite(quant.dequantize(bits, fmt, bits.shape))]
        raw, rows, cols = bits.view(np.uint8), 1, bits.size
    want = quant.dequantize(raw, fmt, (rows, cols))
    got = np.empty(rows * cols, np.float32)
    assert host_decoder(fmt.encode(), raw.ctypes.data, rows * cols, rows,
                        quant.nbytes(fmt, (1, cols)), got.ctypes.data) == 0
    np.testing.assert_array_equal(got.view(np.uint32), want.ravel().view(np.uint32))


# --- mixed precision: tensor-core matmuls (kernels/tc_layout.cuh, kernels/tc_matmul.cu) ----------
# The kernels' index math lives in tc_layout.cuh as plain integer functions. Here it is
# compiled for the host and replayed, per lane and register, through a numpy emulator of
# mma.sync written from the PTX ISA's fragment layouts ("Matrix Fragments for mma.m16n8k16
# with floating point type", "Matrix Fragments for mma.m16n8k8", .bf16 / .tf32 / f32 C),
# so a wrong (lane, register) -> (row, col) mapping shows up as a wrong matmul here.
from toygraph.cuda.kernels import (TC_FAMILIES, TC_KERNEL_NAMES, TC_KERNELS,  # noqa: E402
                                   TC_PRECISIONS, backend_source)

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
    import shutil
    import subprocess
    from toygraph.cuda.constants import constant_defines
    from toygraph.cuda.kernels import read_source
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("tclayout")
    src = d / "tc_layout.cpp"
    src.write_text("#define __device__\n#define __forceinline__ inline\n"
                   + constant_defines() + read_source("tc_layout.cuh") + _TC_HOST_DRIVER)
    lib = d / "tc_layout.so"
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True,
                   capture_output=True)
    so = ctypes.CDLL(str(lib))
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


# The PTX ISA's fragment layouts, written from the documentation independently of the
# kernels (g = groupID = lane >> 2, t = threadID_in_group = lane % 4). Element i of a lane.
def _ptx_a(prec, lane, i):
    g, t = lane >> 2, lane % 4
    if prec == "bf16":   # m16n8k16 .bf16, a0..a7
        row = g if (i < 2 or 4 <= i < 6) else g + 8
        col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    else:                # m16n8k8 .tf32, a0..a3
        row = g if i in (0, 2) else g + 8
        col = t if i in (0, 1) else t + 4
    return row, col


def _ptx_b(prec, lane, i):   # (row = k, col = n) of B [K, 8]
    g, t = lane >> 2, lane % 4
    if prec == "bf16":   # b0..b3
        return t * 2 + (i & 1) + (8 if i >= 2 else 0), g
    return (t if i == 0 else t + 4), g   # b0, b1


def _ptx_c(lane, i):         # f32 accumulators c0..c3 of the 16 x 8 C/D
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


_MMA_K = {"bf16": 16, "tf32": 8}


def _mma_emulate(prec, a, b, c):
    """One warp's mma.sync: a [32, nA], b [32, nB], c [32, 4] per-lane element values in
    the PTX layouts -> d [32, 4]. Each documented position must be held exactly once."""
    K = _MMA_K[prec]
    A, B, C = np.full((16, K), np.nan), np.full((K, 8), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(a.shape[1]):
            r, col = _ptx_a(prec, lane, i)
            assert np.isnan(A[r, col]), "two lanes hold one A element"
            A[r, col] = a[lane, i]
        for i in range(b.shape[1]):
            r, col = _ptx_b(prec, lane, i)
            assert np.isnan(B[r, col])
            B[r, col] = b[lane, i]
        for i in range(4):
            r, col = _ptx_c(lane, i)
            assert np.isnan(C[r, col])
            C[r, col] = c[lane, i]
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any())
    D = A @ B + C
    return np.array([[D[_ptx_c(lane, i)] for i in range(4)] for lane in range(32)])


def _round_bf16(x):
    """cvt.rn.bf16.f32: round to nearest even, kept as the f32 with those top 16 bits."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _round_tf32(x):
    """cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x1000) & 0xFFFFE000
    return u.astype(np.uint32).view(np.float32)


_ROUND = {"bf16": _round_bf16, "tf32": _round_tf32}


def _kernel_frags(L, prec, As, Bs, ld, a_row0, b_row0, kk):
    """The registers the kernel loads (P::a_reg / P::b_reg) from flat shared tiles As/Bs
    (row stride ld) for the 16 x K A tile at row a_row0 and the 8 x K B tile at b_row0,
    expanded to per-lane elements in register order (low half first)."""
    fa, fb = L["frag"][prec]
    pair = L["pair"][prec]
    h = np.arange(pair)
    ia = (a_row0 + fa[:, :, 0, None]) * ld + kk + fa[:, :, 1, None] + h   # [32, regs, pair]
    ib = (b_row0 + fb[:, :, 0, None]) * ld + kk + fb[:, :, 1, None] + h
    return As[ia].reshape(32, -1), Bs[ib].reshape(32, -1), ia, ib


@pytest.mark.parametrize("prec", TC_PRECISIONS)
def test_tc_fragment_loads_and_stores_reproduce_one_mma_tile(prec, tc_layout):
    """A single 16 x 8 x K mma: the kernel's per-lane loads from [rows][k] shared tiles,
    the documented mma, and the kernel's per-lane stores give A @ B exactly."""
    L = tc_layout
    rng = np.random.default_rng(0)
    K, ld = _MMA_K[prec], L["ld"][prec]
    A, B = rng.normal(size=(16, K)), rng.normal(size=(K, 8))
    As, Bs = np.zeros(16 * ld), np.zeros(8 * ld)
    As.reshape(16, ld)[:, :K] = A
    Bs.reshape(8, ld)[:, :K] = B.T          # B staged n-major: Bs[n][k]
    a, b, _, _ = _kernel_frags(L, prec, As, Bs, ld, 0, 0, 0)
    d = _mma_emulate(prec, a, b, np.zeros((32, 4)))
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
    assert L["BM"] == L["BN"] == lowering.TC_TILE
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
        _, _, ia, ib = _kernel_frags(L, prec, tile, tile, ld, 16, 8, kk)
        for idx in (ia, ib):
            assert (idx[:, :, 0] % pair == 0).all()
            words = idx[:, :, 0] // pair
            for r in range(words.shape[1]):
                assert len(set((words[:, r] % 32).tolist())) == 32


def _emulate_tc_block_kernel(L, prec, out, A_at, B_at, M, N, K, akf, bkf):
    """Replay one tc_matmul.cu launch over every block in numpy: stage slices through
    the kernel's staging map (zeros outside M, N, K; rounded like cvt), run each warp's
    mma tiles through the emulator with the kernel's fragment loads, store through the
    kernel's C map with its bounds checks."""
    bk, ld, ks = L["bk"][prec], L["ld"][prec], L["kstep"][prec]
    rnd = _ROUND[prec]
    BM, BN = L["BM"], L["BN"]
    ar, ak = L["stage"](bk, BM, akf)
    br, bkk = L["stage"](bk, BN, bkf)
    for m0 in range(0, M, BM):
        for n0 in range(0, N, BN):
            acc = {}
            for k0 in range(0, K, bk):
                As, Bs = np.zeros(BM * ld), np.zeros(BN * ld)
                for S, rr, kk_, R, at, r0 in ((As, ar, ak, M, A_at, m0), (Bs, br, bkk, N, B_at, n0)):
                    gr, gk = r0 + rr, k0 + kk_
                    ok = (gr < R) & (gk < K)
                    v = np.zeros(rr.size)
                    v[ok] = at(gr[ok], gk[ok])
                    S[rr * ld + kk_] = rnd(v).astype(np.float64)
                for w, (wm, wn) in enumerate(L["warps"]):
                    for i in range(L["MI"]):
                        for j in range(L["NI"]):
                            c = acc.get((w, i, j), np.zeros((32, 4)))
                            for kk in range(0, bk, ks):
                                a, b, _, _ = _kernel_frags(L, prec, As, Bs, ld, wm + 16 * i,
                                                           wn + 8 * j, kk)
                                c = _mma_emulate(prec, a, b, c)
                            acc[w, i, j] = c
            for (w, i, j), c in acc.items():
                wm, wn = L["warps"][w]
                for lane in range(32):
                    for r in range(4):
                        row, col = L["cfrag"][lane, r]
                        gm, gn = m0 + wm + 16 * i + row, n0 + wn + 8 * j + col
                        if gm < M and gn < N:
                            out[gm * N + gn] = c[lane, r]


def _emulate_tc_launch(L, launch, mem, raw=None):
    prec = launch.kernel.rsplit("_", 1)[1]
    a = [x[0] if x.size == 1 else x for x in launch.args]
    out, x = mem[int(a[0])], mem[int(a[1])]
    if launch.kernel.startswith("tg_tc_matmul_"):
        M, N, K, sam, sak, sbk, sbn, nbatch = (int(v) for v in a[3:11])
        y = mem[int(a[2])]
        oa, ob = _walk(a[11], nbatch)
        assert launch.grid[2] == min(nbatch, lowering.MAX_GRID_YZ)
        for z in range(nbatch):
            view = out[z * M * N:(z + 1) * M * N]
            _emulate_tc_block_kernel(
                L, prec, view,
                lambda r, k, o=oa[z]: x[o + r * sam + k * sak],
                lambda n, k, o=ob[z]: y[o + n * sbn + k * sbk],
                M, N, K, int(sak == 1), int(sbk == 1))
    else:   # tg_tc_qmm_{nt,nn}_<fmt>_<prec>: W decoded from its blocks
        kind = launch.kernel.split("_")[3]
        M, N, K = (int(v) for v in a[3:6])
        W = raw   # the dequantized [rows, cols] weight
        Bnk = W if kind == "nt" else W.T
        _emulate_tc_block_kernel(L, prec, out, lambda r, k: x[r * K + k],
                                 lambda n, k: Bnk[n, k], M, N, K, 1, int(kind == "nt"))
    assert launch.grid[:2] == (-(-int(a[4]) // L["BN"]), -(-int(a[3]) // L["BM"]))
    assert launch.block == (L["THREADS"], 1, 1)


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
    launches = lowering.lower(node, lambda t: addr[t.id], precision=prec)
    assert [l.kernel for l in launches] == [TC_KERNELS[prec]["matmul"]]
    _emulate_tc_launch(tc_layout, launches[0], mem)
    got = mem[addr[node.id]].reshape(node.shape)
    # exactly the matmul of the rounded inputs (f64 sums here) ...
    want = np.zeros(node.shape)
    rnd = _ROUND[prec]
    CPU_KERNELS["matmul"](want, [rnd(xv).astype(np.float64), rnd(yv).astype(np.float64)],
                          node.attrs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
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
    elems = quant.BLOCK[fmt][0]
    rows, cols = 70, max(2 * elems, 96) if elems < 256 else 256
    raw, wv = _qweight(rng, fmt, rows, cols)
    g = Graph()
    w = g.const("w", raw, shape=(rows, cols), storage=fmt)
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
    launches = lowering.lower(node, lambda t: addr[t.id], raw_consts={w.id}, precision=prec)
    kind = "nn" if build == "backward" else "nt"
    assert [l.kernel for l in launches] == [TC_KERNELS[prec][kind][fmt]]
    q = lowering.lower(node, lambda t: addr[t.id], raw_consts={w.id})[0]  # the f32 kernel's
    assert [a.tolist() for a in launches[0].args] == [a.tolist() for a in q.args]
    _emulate_tc_launch(tc_layout, launches[0], mem, raw=wv.astype(np.float64))
    got = mem[addr[node.id]].reshape(node.shape)
    want = np.zeros(node.shape)
    rnd = _ROUND[prec]
    CPU_KERNELS["matmul"](want, [rnd(xv).astype(np.float64), rnd(wv).astype(np.float64)],
                          node.attrs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_rounding_emulators_match_numpy_and_known_values():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9, -(1 + 2 ** -8), 3.14159], np.float32)
    # bf16 keeps 7 mantissa bits: 1 + 2^-8 is a tie -> even (1.0); 1 + 3*2^-9 rounds up
    np.testing.assert_array_equal(_round_bf16(x)[:4], [1.0, 1.0, 1 + 2 ** -7, -1.0])
    # tf32 keeps 10: ties away from zero
    t = np.array([1 + 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -12], np.float32)
    np.testing.assert_array_equal(_round_tf32(t), [1 + 2 ** -10, -(1 + 2 ** -10), 1.0])
    r = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert np.abs(_round_bf16(r) - r).max() <= np.abs(r).max() * 2 ** -8
    assert np.abs(_round_tf32(r) - r).max() <= np.abs(r).max() * 2 ** -11


# --- the tc kernel table, the module it is compiled into, and the f32 path left alone ----------
def test_tc_kernel_table_and_the_f32_module_is_unchanged():
    assert backend_source("f32") == module_source()
    assert set(TC_PRECISIONS) == set(TC_KERNELS) == {"bf16", "tf32"}
    names = set()
    for prec, table in TC_KERNELS.items():
        names.add(table["matmul"])
        assert set(table["nt"]) == set(table["nn"]) == set(BLOCK_FORMATS)
        names |= set(table["nt"].values()) | set(table["nn"].values())
    assert names == set(TC_KERNEL_NAMES)
    assert not names & set(KERNEL_NAMES)      # the f32 module has none of them
    assert set(kernel_names_of(backend_source("bf16"))) == set(KERNEL_NAMES) | names


def kernel_names_of(src):
    from toygraph.cuda.kernels import kernel_names
    return kernel_names(src)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tc_module_compiles_without_spills(arch, cache):
    """Every tensor-core kernel compiles for sm_80 and sm_90 (inline-PTX mma.sync, cvt to
    bf16/tf32) into the mixed-precision module, and ptxas reports no stack frame or spills
    (register arrays indexed only by unrolled constants; 64 f32 accumulators per thread)."""
    from toygraph.cuda.nvrtc import compile_cubin, resource_usage
    cubin = compile_cubin(backend_source("bf16"), arch=arch, name="toygraph_tc.cu")
    assert cubin[:4] == b"\x7fELF"
    for name in (*KERNEL_NAMES, *TC_KERNEL_NAMES):
        assert name.encode() in cubin, name
    usage = resource_usage(module_source(TC_FAMILIES), arch, name="tc_matmul.cu")
    assert set(usage) == set(TC_KERNEL_NAMES)
    for name, u in usage.items():
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
        assert 0 < u["registers"] <= 255, (name, u)
        assert 0 < u["smem"] <= 48 * 1024, (name, u)   # static limit, no opt-in needed


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_llama_kquant"])
@pytest.mark.parametrize("prec", TC_PRECISIONS)
def test_mixed_precision_lowering_changes_only_the_matmuls(model, prec, request):
    """bf16/tf32 swap each matmul for its tensor-core kernel with the same arguments; every
    other launch, and the whole f32 lowering, is identical to the default."""
    g = _lora_graph(request.getfixturevalue(model), targets=("q", "k", "v", "o", "gate"))
    order, pinned, plan, outputs = _training_plan(g)
    raw = frozenset(devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
                    .raw_consts)
    addr = {t.id: (i + 1) << 20 for i, t in enumerate(order)}
    seen = 0
    for node in order:
        if node.op is None:
            continue
        args = (node, lambda t: addr[t.id], 1 << 40, raw)
        base = lowering.lower(*args)
        same = lowering.lower(*args, precision="f32")
        tc = lowering.lower(*args, precision=prec)
        assert [(l.kernel, l.grid, l.block, [a.tolist() for a in l.args]) for l in base] == \
               [(l.kernel, l.grid, l.block, [a.tolist() for a in l.args]) for l in same]
        if node.op != "matmul":
            assert [(l.kernel, l.grid, [a.tolist() for a in l.args]) for l in base] == \
                   [(l.kernel, l.grid, [a.tolist() for a in l.args]) for l in tc]
            continue
        seen += 1
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
    from toygraph.session import Session
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


# --- fused attention: the tiled algorithm replayed per launch, and its compiled kernels ---------
import re  # noqa: E402

from toygraph.cuda.constants import ATTN_HEAD_DIMS  # noqa: E402
from toygraph.cuda.kernels import read_source  # noqa: E402


def _resolve(mem, addr):
    """(array, element offset) of an f32 device address inside one of ``mem``'s buffers."""
    base = max(b for b in mem if b <= addr)
    assert (addr - base) % 4 == 0 and (addr - base) // 4 < mem[base].size, "address out of range"
    return mem[base], (addr - base) // 4


def _attn_tile(mem, addr, r0, T, hd, BT, HD):
    """Rows [r0, r0 + BT) of the [T, hd] matrix at ``addr``, zero-filled to [BT, HD]."""
    arr, off = _resolve(mem, addr)
    out = np.zeros((BT, HD))
    n = max(0, min(BT, T - r0))
    out[:n, :hd] = arr[off + r0 * hd:off + (r0 + n) * hd].reshape(n, hd)
    return out


def _emulate_attention(launch, mem):
    """Replay one attention launch block by block with the kernel's own loop bounds, tiles,
    online softmax, scratch layout and output addresses (numpy, f64)."""
    name = launch.kernel
    HD = int(name.rsplit("_", 1)[1])
    BT, TPR = lowering.ATTN_TILES[HD]
    assert launch.block == (BT * TPR, 1, 1)
    a = [x[0] for x in launch.args]
    H, KV, T, hd, scale, causal, window = (int(a[-7]), int(a[-6]), int(a[-5]), int(a[-4]),
                                           float(a[-3]), int(a[-2]), int(a[-1]))
    ptrs = [int(x) for x in a[:-7]]
    G, nt, head = H // KV, (T + BT - 1) // BT, T * hd
    gx, gy, gz = launch.grid
    ar = np.arange(BT)

    def visible(i0, j0):
        i, j = i0 + ar[:, None], j0 + ar[None, :]
        vis = (i < T) & (j < T) & ((j <= i) if causal else True)
        return vis & (i - j < window) if window else vis

    def key_tiles(qt):  # the kernels' tile loop bounds (attn_first_key_tile and causal last)
        first = max(0, qt * BT - window + 1) // BT if window else 0
        return range(first, (qt if causal else nt - 1) + 1)

    def query_tiles(kt):  # attn_last_query_tile
        last = min(nt - 1, (kt * BT + BT - 1 + window - 1) // BT) if window else nt - 1
        return range(kt if causal else 0, last + 1)

    def tile_pair(i0, j0):  # a tile pair the kernels visit: none with nothing visible
        assert visible(i0, j0).any(), ("a visited tile is wholly masked", i0, j0)
        return i0, j0

    def write(addr, rows0, vals):  # rows [rows0, rows0 + BT) of a [T, hd] matrix
        arr, off = _resolve(mem, addr)
        n = max(0, min(BT, T - rows0))
        arr[off + rows0 * hd:off + (rows0 + n) * hd] = vals[:n, :hd].ravel()

    def scores(Q, i0, kaddr, qt):
        """Online row max / sum over query tile qt's key tiles; yields per tile (j0, s, base)."""
        m, l = np.full(BT, -np.inf), np.zeros(BT)
        for kt in key_tiles(qt):
            Ks = _attn_tile(mem, kaddr, kt * BT, T, hd, BT, HD)
            s = np.where(visible(*tile_pair(i0, kt * BT)), (Q @ Ks.T) * scale, -np.inf)
            mn = np.maximum(m, s.max(1))
            base = np.where(mn == -np.inf, 0.0, mn)
            p = np.exp(s - base[:, None])
            alpha = np.exp(m - base)
            l = l * alpha + p.sum(1)
            m = mn
            yield kt * BT, p, alpha, m, l

    if name.startswith("tg_attn_fwd_") or name.startswith("tg_attn_bwd_prep_"):
        assert (gx, gy, gz) == (nt, H, launch.grid[2])
        for b in range(gz):
            for h in range(H):
                kv = b * KV + h // G
                for qt in range(nt):
                    i0 = qt * BT
                    if name.startswith("tg_attn_fwd_"):
                        out, q, k, v = ptrs
                        Q = _attn_tile(mem, q + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        acc = np.zeros((BT, HD))
                        for j0, p, alpha, m, l in scores(Q, i0, k + 4 * kv * head, qt):
                            Vs = _attn_tile(mem, v + 4 * kv * head, j0, T, hd, BT, HD)
                            acc = acc * alpha[:, None] + p @ Vs
                        write(out + 4 * (b * H + h) * head, i0, acc / l[:, None])
                    else:
                        lse, delta, q, k, o, g = ptrs
                        Q = _attn_tile(mem, q + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        for _, _, _, m, l in scores(Q, i0, k + 4 * kv * head, qt):
                            pass
                        O = _attn_tile(mem, o + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        dO = _attn_tile(mem, g + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                        n = max(0, min(BT, T - i0))
                        L, Lo = _resolve(mem, lse + 4 * ((b * H + h) * T + i0))
                        D, Do = _resolve(mem, delta + 4 * ((b * H + h) * T + i0))
                        L[Lo:Lo + n] = (m + np.log(l))[:n]
                        D[Do:Do + n] = (O * dO).sum(1)[:n]
        return
    if name.startswith("tg_attn_bwd_dkdv_"):
        dk, dv, q, k, v, g, lse, delta = ptrs
        assert (gx, gy) == (nt, KV)
        for b in range(gz):
            for kvh in range(KV):
                kv = b * KV + kvh
                for kt in range(nt):
                    j0 = kt * BT
                    Ks = _attn_tile(mem, k + 4 * kv * head, j0, T, hd, BT, HD)
                    Vs = _attn_tile(mem, v + 4 * kv * head, j0, T, hd, BT, HD)
                    dka, dva = np.zeros((BT, HD)), np.zeros((BT, HD))
                    for h in range(kvh * G, kvh * G + G):
                        qa, ga = q + 4 * (b * H + h) * head, g + 4 * (b * H + h) * head
                        for qt in query_tiles(kt):
                            i0 = qt * BT
                            Q = _attn_tile(mem, qa, i0, T, hd, BT, HD)
                            dO = _attn_tile(mem, ga, i0, T, hd, BT, HD)
                            rows = np.minimum(i0 + ar, T - 1) + (b * H + h) * T
                            L, Lo = _resolve(mem, lse)
                            D, Do = _resolve(mem, delta)
                            Li = np.where(i0 + ar < T, L[Lo + rows], 0.0)
                            Di = np.where(i0 + ar < T, D[Do + rows], 0.0)
                            vis = visible(*tile_pair(i0, j0))      # [query, key]
                            p = np.where(vis, np.exp((Q @ Ks.T) * scale - Li[:, None]), 0.0)
                            ds = p * ((dO @ Vs.T) - Di[:, None]) * scale
                            dva += p.T @ dO
                            dka += ds.T @ Q
                    write(dk + 4 * kv * head, j0, dka)
                    write(dv + 4 * kv * head, j0, dva)
        return
    if name.startswith("tg_attn_bwd_dq_"):
        dq, q, k, v, g, lse, delta = ptrs
        assert (gx, gy) == (nt, H)
        for b in range(gz):
            for h in range(H):
                kv = b * KV + h // G
                for qt in range(nt):
                    i0 = qt * BT
                    Q = _attn_tile(mem, q + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                    dO = _attn_tile(mem, g + 4 * (b * H + h) * head, i0, T, hd, BT, HD)
                    rows = np.minimum(i0 + ar, T - 1) + (b * H + h) * T
                    L, Lo = _resolve(mem, lse)
                    D, Do = _resolve(mem, delta)
                    Li = np.where(i0 + ar < T, L[Lo + rows], 0.0)
                    Di = np.where(i0 + ar < T, D[Do + rows], 0.0)
                    acc = np.zeros((BT, HD))
                    for kt in key_tiles(qt):
                        j0 = kt * BT
                        Ks = _attn_tile(mem, k + 4 * kv * head, j0, T, hd, BT, HD)
                        Vs = _attn_tile(mem, v + 4 * kv * head, j0, T, hd, BT, HD)
                        p = np.where(visible(*tile_pair(i0, j0)),
                                     np.exp((Q @ Ks.T) * scale - Li[:, None]), 0.0)
                        acc += (p * ((dO @ Vs.T) - Di[:, None]) * scale) @ Ks
                    write(dq + 4 * (b * H + h) * head, i0, acc)
        return
    raise AssertionError(f"no emulation for {name}")


ATTN_LOWERING_CASES = [  # (B, H, KV, T, hd, causal): T off the tile, GQA, every HD bound
    (2, 4, 2, 37, 8, True), (2, 4, 2, 37, 8, False), (1, 6, 2, 70, 64, True),
    (1, 2, 1, 35, 100, True), (2, 3, 3, 16, 128, False), (1, 9, 3, 64, 64, True),
]


@pytest.mark.parametrize("B,H,KV,T,hd,causal", ATTN_LOWERING_CASES)
def test_attention_launches_replayed_in_numpy_match_the_cpu_kernels(B, H, KV, T, hd, causal):
    """Grid, block, tile loop bounds (causal skipping), grouped-query head mapping, the
    scratch layout of the row statistics and the packed [dq, dk, dv] addresses."""
    replay_attention_launches(B, H, KV, T, hd, causal)


def replay_attention_launches(B, H, KV, T, hd, causal, window=0):
    """Lower attention and its backward, replay every launch with _emulate_attention and
    compare with the numpy kernels (test_cuda_new_ops.py runs it with sliding windows)."""
    rng = np.random.default_rng(0)
    g = Graph()
    vals = [rng.normal(size=s) for s in ((B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd))]
    q, k, v = (g.const(n, x) for n, x in zip("qkv", vals))
    # The kernels take the scale as an f32 argument: give both sides that value.
    att = ops.attention(q, k, v, scale=float(np.float32(hd ** -0.5)), causal=causal,
                        window=window)
    gout = g.const("gout", rng.normal(size=att.shape))
    back = ops.OPS["attention"].grad(att, gout, [True] * 3)[0].srcs[0]
    addr = {t.id: (i + 1) << 24 for i, t in enumerate((q, k, v, gout, att, back))}
    mem = {addr[t.id]: np.asarray(x, np.float64).ravel().copy()
           for t, x in zip((q, k, v, gout), (*vals, gout.data))}
    for t in (att, back):
        mem[addr[t.id]] = np.full(t.size, np.nan)  # every element must be written
    scratch = 200 << 24
    assert lowering.scratch_bytes(att) == 0
    mem[scratch] = np.full(lowering.scratch_bytes(back) // 4, np.nan)
    for node in (att, back):
        launches = lowering.lower(node, lambda t: addr[t.id], scratch)
        assert [l.kernel.rsplit("_", 1)[0] for l in launches] == (
            ["tg_attn_fwd"] if node is att else
            ["tg_attn_bwd_prep", "tg_attn_bwd_dkdv", "tg_attn_bwd_dq"])
        for launch in launches:
            assert all(isinstance(x, np.ndarray) and x.dtype in (np.int32, np.uint64, np.float32)
                       for x in launch.args)
            assert launch.kernel in KERNEL_NAMES
            assert launch.kernel in OP_KERNELS[node.op]
            _emulate_attention(launch, mem)
    for node, srcs in ((att, vals), (back, (*vals, mem[addr[att.id]].reshape(att.shape),
                                            gout.data))):
        want = np.zeros(node.shape)
        CPU_KERNELS[node.op](want, [np.asarray(x, np.float64) for x in srcs], node.attrs)
        got = mem[addr[node.id]]
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got.reshape(node.shape), want, rtol=1e-10, atol=1e-10)


def test_unpack_lowers_to_a_copy_from_the_offset():
    g = Graph()
    x = g.const("x", np.arange(20.0))
    node = ops.unpack(x, 7, (3, 4))
    (launch,) = lowering.lower(node, lambda t: (t.id + 1) << 20)
    assert launch.kernel == "tg_copy" and launch.kernel in OP_KERNELS["unpack"]
    assert int(launch.args[1][0]) == ((x.id + 1) << 20) + 4 * 7 and int(launch.args[2][0]) == 12


def test_attention_head_dim_selection_and_limit():
    assert [lowering.attention_config(hd)[0] for hd in (1, 32, 33, 64, 65, 128)] == \
        [32, 32, 64, 64, 128, 128]
    g = Graph()
    q = g.const("q", np.zeros((1, 2, 4, 160)))
    with pytest.raises(CudaError, match="head_dim 160"):
        lowering.lower(ops.attention(q, q, q, scale=1.0), lambda t: 1 << 20)


def test_attention_instantiations_match_the_lowering_tiles():
    """attention.cu's wrapper for head_dim bound HD passes (HD, TG_ATTN_BT_<HD>,
    TG_ATTN_TPR_<HD>), with __launch_bounds__(TG_ATTN_THREADS_<HD>), and those macros are
    the (BT, TPR, BT * TPR) that lowering.ATTN_TILES launches with."""
    from toygraph.cuda.constants import DEFINES
    src = read_source("attention.cu")
    instantiated = {int(hd) for hd in re.findall(r"\btg_attn_fwd_(\d+)\(", src)}
    assert instantiated == set(ATTN_HEAD_DIMS) == set(lowering.ATTN_TILES)
    for part in ("fwd", "bwd_prep", "bwd_dkdv", "bwd_dq"):
        for HD, (BT, TPR) in lowering.ATTN_TILES.items():
            m = re.search(rf"__launch_bounds__\((\w+)\)\s+tg_attn_{part}_{HD}\(.*?\)\s*{{\s*"
                          rf"attn_{part}<(\w+), (\w+), (\w+)>", src, re.S)
            assert m, (part, HD)
            assert m.groups() == (f"TG_ATTN_THREADS_{HD}", str(HD), f"TG_ATTN_BT_{HD}",
                                  f"TG_ATTN_TPR_{HD}")
            assert [DEFINES[x] for x in (m[1], m[3], m[4])] == [BT * TPR, BT, TPR]


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_attention_kernels_compile_without_spills(arch, cache):
    """Register arrays indexed by unrolled constants only (no stack, no spills) and static
    shared memory within the 48 KB a block gets without an opt-in."""
    from toygraph.cuda.nvrtc import resource_usage
    names = {n for op in ("attention", "attention_back") for n in OP_KERNELS[op]}
    usage = resource_usage(module_source(("attention.cu",)), arch, name="attention.cu")
    assert set(usage) == names
    for name, u in usage.items():
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
        assert 0 < u["registers"] <= 255, (name, u)
        assert 0 < u["smem"] <= 48 * 1024, (name, u)


# --- fused output head + cross-entropy: launch sequence over row chunks, replayed in numpy ------
def _lce_emulate(launch, mem):
    """Replay one launch of the linear_cross_entropy lowering with the kernel's semantics
    (f64), on buffers found by address (pointers into the middle of a buffer included)."""
    k, a = launch.kernel, launch.args
    sc = [x[0] if x.size == 1 else x for x in a]

    def view(addr, n, dtype=np.float64):
        arr, off = _resolve(mem, int(addr))
        assert off + n <= arr.size, f"{k}: reads past the buffer"
        return arr[off:off + n]

    if k in ("tg_matmul", "tg_matmul_acc"):
        M, N, K, sam, sak, sbk, sbn, nbatch = (int(v) for v in sc[3:11])
        assert nbatch == 1 and int(a[11][0]) == 0 and launch.grid == (-(-N // 64), -(-M // 64), 1)
        A, _ = _resolve(mem, int(sc[1]))
        B, _ = _resolve(mem, int(sc[2]))
        oa, ob = _resolve(mem, int(sc[1]))[1], _resolve(mem, int(sc[2]))[1]
        m, kk, n = np.arange(M)[:, None], np.arange(K)[None, :], np.arange(N)[None, :]
        prod_ = A[oa + m * sam + kk * sak] @ B[ob + kk.T * sbk + n * sbn]
        out = view(sc[0], M * N)
        out[:] = (out if k == "tg_matmul_acc" else 0) + prod_.ravel()
    elif k in {n for names in QUANT_KERNELS.values() for n in (names["nt"], names["nn"])}:
        fmt, kind = _qmm_format(k)
        out, x, w, M, N, K, rb = (int(v) for v in sc)
        raw, off = _resolve(mem, w)
        assert off == 0
        elems, size = quant.BLOCK[fmt]
        cols = rb // size * elems
        W = quant.dequantize(raw, fmt, (raw.size // rb, cols)).astype(np.float64)
        B = W.T if kind == "nt" else W
        assert B.shape == (K, N)
        view(out, M * N)[:] = (view(x, M * K).reshape(M, K) @ B).ravel()
    elif k == "tg_ce_rows":
        rowloss, logits, labels, N, V = (int(v) for v in sc)
        z = view(logits, N * V).reshape(N, V)
        lab = view(labels, N).astype(np.int64)
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        view(rowloss, N)[:] = np.where(lab >= 0, lse - z[np.arange(N), np.maximum(lab, 0)], 0.0)
    elif k == "tg_ce_reduce":
        out, rowloss, labels, N, mean = (int(v) for v in sc)
        total, n = view(rowloss, N).sum(), int((view(labels, N) >= 0).sum())
        view(out, 1)[:] = total if not mean else (total / n if n else 0.0)
    elif k == "tg_lce_grad_scale":
        gs, labels, N, g, mean = (int(v) for v in sc)
        n, gv = int((view(labels, N) >= 0).sum()), view(g, 1)[0]
        view(gs, 1)[:] = gv if not mean else (gv / n if n else 0.0)
    elif k == "tg_ce_back":   # the kernel counts only the labels it is given
        out, logits, labels, g, N, V, mean = (int(v) for v in sc)
        lab = view(labels, N).astype(np.int64)
        n = int((lab >= 0).sum())
        w = view(g, 1)[0] if not mean else (view(g, 1)[0] / n if n else 0.0)
        z = view(logits, N * V).reshape(N, V)
        e = np.exp(z - z.max(1, keepdims=True))
        pr = e / e.sum(1, keepdims=True)
        valid = lab >= 0
        pr[np.arange(N)[valid], lab[valid]] -= 1.0
        view(out, N * V)[:] = (pr * np.where(valid, w, 0.0)[:, None]).ravel()
    elif k == "tg_fill":
        view(sc[0], int(sc[1]))[:] = float(sc[2])
    else:
        raise AssertionError(f"no emulation for {k}")


def _lce_case(rng, N, D, V, labels, fmt=None):
    g = Graph()
    hv = rng.normal(size=(N, D))
    if fmt is None:
        wv = rng.normal(size=(V, D))
        w = g.const("w", wv)
        raw = None
    else:
        raw = quant.quantize(rng.normal(size=(V, D)).astype(np.float32), fmt)
        w = g.const("w", raw, shape=(V, D), storage=fmt)
        wv = quant.dequantize(raw, fmt, (V, D)).astype(np.float64)
    h = g.const("h", hv)
    lab = g.input("lab", (N,), "i32")
    labv = np.asarray(labels, np.int64)
    return g, h, w, lab, hv, wv, labv, raw


def _lce_replay(node, vals, raw, scratch_nan=True):
    """Lower ``node`` (raw_consts = its head when ``raw`` is given), replay every launch and
    return (launches, the output as computed, scratch)."""
    addr = {s.id: (i + 1) << 26 for i, s in enumerate(node.srcs)}
    addr[node.id] = 60 << 26
    mem = {}
    for s, v in zip(node.srcs, vals):
        mem[addr[s.id]] = (quant._as_bytes(raw).copy() if (raw is not None and s is node.srcs[1])
                           else np.asarray(v, np.float64).ravel().copy())
    mem[addr[node.id]] = np.full(max(node.size, 1), np.nan)
    scratch = 70 << 26
    n_scr = lowering.scratch_bytes(node)
    assert n_scr % 256 == 0 and n_scr > 0
    mem[scratch] = np.full(n_scr // 4, np.nan if scratch_nan else 0.0)
    raw_consts = frozenset({node.srcs[1].id}) if raw is not None else frozenset()
    launches = lowering.lower(node, lambda t: addr[t.id], scratch, raw_consts)
    for launch in launches:
        assert all(isinstance(x, np.ndarray) and x.dtype in (np.int32, np.uint64, np.float32)
                   for x in launch.args), launch.kernel
        assert launch.kernel in KERNEL_NAMES, launch.kernel
        _lce_emulate(launch, mem)
    return launches, mem[addr[node.id]], mem[scratch]


LCE_LOWERING_LABELS = {
    "some_ignored": lambda rng, N, V: np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)),
    "all_ignored": lambda rng, N, V: np.full(N, -1),
}


@pytest.mark.parametrize("labels", list(LCE_LOWERING_LABELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows,N", [(7, 30), (64, 150), (None, 40)])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_linear_cross_entropy_launches_replayed_in_numpy_match_the_cpu_kernels(
        chunk_rows, N, reduction, labels, grads, monkeypatch):
    """Forward and backward launch sequences over row chunks (ragged last chunk, one chunk,
    dh and/or dw) give the numpy kernels' values; only the [rows, V] scratch block is used."""
    rng = np.random.default_rng(5)
    D, V = 12, 70
    if chunk_rows is not None:
        monkeypatch.setattr(lower_fused, "LCE_CHUNK_BYTES", 4 * V * chunk_rows)
    rows = lowering.lce_chunk_rows(N, V)
    assert rows == (chunk_rows or N)
    g, h, w, lab, hv, wv, labv, _ = _lce_case(rng, N, D, V,
                                              LCE_LOWERING_LABELS[labels](rng, N, V))
    loss = ops.linear_cross_entropy(h, w, lab, reduction=reduction)
    gout = g.const("gout", np.array(1.7))
    back = g.node("linear_cross_entropy_back", [h, w, lab, gout],
                  dict(reduction=reduction, grad_h=grads[0], grad_w=grads[1]))
    # the scratch is one chunk of logits (not N x V) plus the row losses / one weight
    assert lowering.scratch_bytes(loss) == -(-4 * rows * V // 256) * 256 + -(-4 * N // 256) * 256
    assert lowering.scratch_bytes(back) == -(-4 * rows * V // 256) * 256 + 256
    launches, got, _ = _lce_replay(loss, [hv, wv, labv], None)
    chunks = -(-N // rows)
    assert [l.kernel for l in launches] == ["tg_matmul", "tg_ce_rows"] * chunks + ["tg_ce_reduce"]
    assert set(l.kernel for l in launches) <= set(OP_KERNELS["linear_cross_entropy"])
    want = np.zeros(())
    CPU_KERNELS["linear_cross_entropy"](want, [hv, wv, labv], loss.attrs)
    np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)
    launches, got, _ = _lce_replay(back, [hv, wv, labv, 1.7], None)
    per_chunk = ["tg_matmul", "tg_ce_back"] + ["tg_matmul"] * grads[0] + ["tg_matmul_acc"] * grads[1]
    assert [l.kernel for l in launches] == (["tg_lce_grad_scale"] + ["tg_fill"] * grads[1]
                                            + per_chunk * chunks)
    assert set(l.kernel for l in launches) <= set(OP_KERNELS["linear_cross_entropy_back"])
    want = np.zeros(back.shape)
    CPU_KERNELS["linear_cross_entropy_back"](want, [hv, wv, labv, np.array(1.7)], back.attrs)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "f16"])
def test_linear_cross_entropy_reads_a_block_format_head_through_the_fused_kernels(fmt,
                                                                                   monkeypatch):
    """A frozen quantized head (SmolLM2's tied Q8_0 token_embd): logits through the "nt"
    and dh through the "nn" qmatmul kernels, never an f32 copy; no dw is possible."""
    rng = np.random.default_rng(6)
    N, V = 37, 70
    D = 256 if quant.BLOCK[fmt][0] == 256 else 64
    monkeypatch.setattr(lower_fused, "LCE_CHUNK_BYTES", 4 * V * 16)
    g, h, w, lab, hv, wv, labv, raw = _lce_case(
        rng, N, D, V, np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)), fmt)
    loss = ops.linear_cross_entropy(h, w, lab, reduction="mean")
    back = ops.OPS["linear_cross_entropy"].grad(loss, g.const("gout", np.array(0.9)),
                                                [True, False, False])[0].srcs[0]
    assert back.shape == (N * D,)
    assert lowering.reads_block_format(loss, 1) and lowering.reads_block_format(back, 1)
    assert not lowering.reads_block_format(loss, 0)
    for node, vals in ((loss, [hv, wv, labv]), (back, [hv, wv, labv, 0.9])):
        launches, got, _ = _lce_replay(node, vals, raw)
        mm = [l.kernel for l in launches if "mm" in l.kernel or l.kernel == "tg_matmul"]
        assert mm and set(mm) <= {QUANT_KERNELS[fmt]["nt"], QUANT_KERNELS[fmt]["nn"]}
        want = np.zeros(node.shape)
        CPU_KERNELS[node.op](want, [hv, wv, labv] + ([np.array(0.9)] if node is back else []),
                             node.attrs)
        np.testing.assert_allclose(got[:max(node.size, 1)].reshape(node.shape), want,
                                   rtol=1e-10, atol=1e-12)
    gw = g.node("linear_cross_entropy_back", [h, w, lab, g.const("g2", np.array(1.0))],
                dict(reduction="sum", grad_h=True, grad_w=True))
    assert not lowering.reads_block_format(gw, 1)
    with pytest.raises(CudaError, match="block format"):
        lowering.lower(gw, lambda t: 1 << 20, 1 << 30, frozenset({w.id}))


@pytest.mark.parametrize("prec", TC_PRECISIONS)
def test_linear_cross_entropy_in_mixed_precision_uses_tensor_core_matmuls(prec):
    """bf16/tf32: logits and dh on the tensor-core kernels (same arguments, 128-row tiles),
    dw accumulation stays tg_matmul_acc (f32; it has no tensor-core twin)."""
    rng = np.random.default_rng(7)
    g, h, w, lab, *_ = _lce_case(rng, 300, 64, 100, np.zeros(300))
    back = g.node("linear_cross_entropy_back", [h, w, lab, g.const("g", np.array(1.0))],
                  dict(reduction="sum", grad_h=True, grad_w=True))
    base = lowering.lower(back, lambda t: (t.id + 1) << 24, 1 << 30)
    tc = lowering.lower(back, lambda t: (t.id + 1) << 24, 1 << 30, precision=prec)
    assert [l.kernel for l in base] == ["tg_lce_grad_scale", "tg_fill", "tg_matmul", "tg_ce_back",
                                        "tg_matmul", "tg_matmul_acc"]
    assert [l.kernel for l in tc] == [TC_KERNELS[prec]["matmul"] if k == "tg_matmul" else k
                                      for k in (l.kernel for l in base)]
    for b, t in zip(base, tc):
        assert [x.tolist() for x in b.args] == [x.tolist() for x in t.args]
        if t.kernel != b.kernel:
            M, N = int(b.args[3][0]), int(b.args[4][0])
            assert t.grid == (-(-N // 128), -(-M // 128), 1) and t.block == (256, 1, 1)


def test_linear_cross_entropy_chunk_rows():
    assert lowering.lce_chunk_rows(8192, 49152) == 1344        # 256 MiB of SmolLM2 logits
    assert lowering.lce_chunk_rows(512, 49152) == 512
    assert lowering.lce_chunk_rows(10 ** 6, 10 ** 6) == 64     # 67 fit: whole tiles
    assert lowering.lce_chunk_rows(10 ** 6, 2 * 10 ** 6) == 33  # under a tile: as many fit
    assert lowering.lce_chunk_rows(5, 10 ** 9) == 1


def _smollm2_training_graph(path, fused, batch, seq, build_training_too=True):
    from toygraph.gguf import GGUFModel
    from toygraph.models.llama import LoraConfig, build_llama, lm_head
    from toygraph.optim import build_training
    model = GGUFModel(path)
    g = Graph()
    net = build_llama(g, model.config, batch=batch, seq_len=seq, model=model, logits=False,
                      lora=LoraConfig(targets=("q", "v"), rank=8, alpha=16))
    lab = g.input("labels", (batch * seq,), "i32")
    loss = (ops.linear_cross_entropy(net.hidden, net.head, lab, reduction="sum") if fused else
            ops.cross_entropy(lm_head(net), lab, reduction="sum"))
    build_training(g.output(loss), net.params, count=g.output(ops.count_valid(lab)),
                   max_norm=1.0)
    return g


def test_smollm2_fused_head_plans_gibibytes_less_and_keeps_the_q8_0_head_in_blocks(smollm2):
    """SmolLM2 LoRA at batch 4 x seq 2048 planned on the host: the unfused head holds
    [8192, 49152] logits and their gradient (1.5 GiB each); the fused one a 1344-row block."""
    sizes = {}
    for fused in (False, True):
        g = _smollm2_training_graph(smollm2, fused, 4, 2048)
        order, pinned, plan, outputs = _training_plan(g)
        mem = devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
        heads = [t for t in order if t.op and t.op.startswith("linear_cross_entropy")]
        sizes[fused] = (plan.arena_bytes, sum(mem.scratch.values()), mem,
                        sum(lowering.scratch_bytes(t) for t in heads))
        if fused:
            embd = next(t for t in order if t.name == "token_embd.weight")
            assert embd.storage == "q8_0" and embd.id in mem.raw_consts
            assert len(mem.raw_consts) == 211
            assert [t.op for t in heads] == ["linear_cross_entropy", "linear_cross_entropy_back"]
            assert heads[1].shape == (8192 * 576,)       # dh only: the head is frozen
            for t in heads:
                kernels = {l.kernel for l in lowering.lower(t, lambda x: 1 << 20, 1 << 40,
                                                            frozenset(mem.raw_consts))}
                assert {"tg_qmm_nt_q8_0"} <= kernels and "tg_matmul" not in kernels
    (arena_u, scr_u, *_), (arena_f, scr_f, *_) = sizes[False], sizes[True]
    logits = 8192 * 49152 * 4
    assert arena_u >= 2 * logits                 # logits and dlogits live together
    assert arena_u + scr_u - (arena_f + scr_f) >= 1.5 * logits
    assert sizes[True][3] == 2 * (1344 * 49152 * 4) + 4 * 8192 + 256  # two blocks, rowloss, gs


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_linear_cross_entropy_kernels_compile_without_spills(arch, cache):
    """tg_matmul_acc (tg_matmul's tiles adding into out) and tg_lce_grad_scale compile for
    sm_80 and sm_90; the accumulating matmul costs no more registers than tg_matmul."""
    from toygraph.cuda.nvrtc import compile_cubin, resource_usage
    src = module_source(("elementwise.cu", "matmul.cu", "loss.cu", "lce.cu"))
    cubin = compile_cubin(src, arch=arch, name="lce.cu")
    names = {n for op in ("linear_cross_entropy", "linear_cross_entropy_back")
             for n in OP_KERNELS[op]}
    for name in names:
        assert name.encode() in cubin, name
    usage = resource_usage(src, arch, name="lce.cu")
    for name in names:
        u = usage[name]
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
    assert usage["tg_matmul_acc"]["registers"] <= usage["tg_matmul"]["registers"] + 8
