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
from toygraph.cuda import lowering
from toygraph.cuda.kernels import DEQUANT_KERNELS, KERNEL_NAMES, OP_KERNELS, module_source
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
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "cubin"))
    return tmp_path / "cubin"


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
