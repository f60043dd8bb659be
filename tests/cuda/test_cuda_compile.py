"""CUDA without a GPU, for the whole kernel module: every kernel compiles with NVRTC for
sm_80 and sm_90, compile errors carry NVRTC's log, the disk cache works, every op has a
lowering whose kernels exist, launch arguments are fixed-width, and the backend fails
cleanly without a device. What each op family's launches compute is replayed in numpy in
its own tests (tests/ops/test_ops_<family>.py); the NVRTC tests skip only when
``cuda.bindings.nvrtc`` cannot be imported (CI installs the ``cuda`` extra).
"""
import numpy as np
import pytest

from support.cudaemu import needs_nvrtc
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.gguf import blocks
from toygraph.ops.lowering import dispatch
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS
from support.kernelsrc import KERNEL_NAMES
from toygraph.ops.lowering.sources import backend_source, kernel_names
from toygraph.ops.lowering.launch import collapse
from support.kernelsrc import OP_KERNELS
from toygraph.errors import CudaError
from toygraph.core.graph import Graph
from support.ptxas import ARCHS  # noqa: E402


# --- the kernel table ------------------------------------------------------------------------
def test_every_op_and_storage_has_a_kernel():
    assert set(OP_KERNELS) == set(ops.OPS)
    for op, names in OP_KERNELS.items():
        for n in names:
            assert n in KERNEL_NAMES, f"{op}: kernel {n} missing from the sources"
    assert set(FORMAT_KERNELS["tg_deq_<fmt>"]) == set(blocks.BLOCK) - {"f32"}
    assert set(FORMAT_KERNELS["tg_deq_<fmt>"].values()) <= set(KERNEL_NAMES)


# --- NVRTC ---------------------------------------------------------------------------------------
@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_whole_module_compiles(arch):
    """The bf16 module holds every f32 file plus the tensor-core ones, and the ptxas tests
    compile it once per arch anyway (support/ptxas.py), so its cubin shows every kernel
    compiles; the f32 module's own compile is the slow test below."""
    from support.ptxas import bf16_module
    cubin, _ = bf16_module(arch)
    assert cubin[:4] == b"\x7fELF"
    for name in KERNEL_NAMES:  # every extern "C" kernel is a symbol of the cubin
        assert name.encode() in cubin, name


@needs_nvrtc
@pytest.mark.slow
def test_the_f32_module_compiles_alone(cache):
    from toygraph.cuda.nvrtc import compile_cubin
    cubin = compile_cubin(backend_source("f32"), arch="sm_90")
    assert cubin[:4] == b"\x7fELF"
    for name in kernel_names(backend_source("f32")):
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


def test_collapse_merges_contiguous_and_broadcast_dims():
    dims, (sa, sb) = collapse([2, 3, 4], [12, 4, 1], [0, 0, 1])
    assert dims == [6, 4] and sa == [4, 1] and sb == [0, 1]
    dims, (sa,) = collapse([1, 5, 1], [5, 1, 1])
    assert dims == [5] and sa == [1]


def test_scalar_arguments_are_fixed_width():
    g = Graph()
    x = g.const("x", np.ones((4, 8)))
    for node in (ops.scale(x, 0.5), ops.rms_norm(x, 1e-5), ops.softmax(x, scale=2.0)):
        for launch in dispatch.lower(node, lambda t: 1 << 20):
            assert all(isinstance(v, np.ndarray) and v.dtype.itemsize in (4, 8) for v in launch.args)


@needs_nvrtc
def test_compiling_leaves_shared_bytes_objects_alone(cache):
    """NVRTC writes its log and cubin into Python buffers; a 1-byte log once went into
    CPython's shared b" " and turned every space in the process into NUL."""
    from toygraph.cuda.nvrtc import compile_cubin
    compile_cubin('extern "C" __global__ void k() {}', arch="sm_80", name="tiny.cu")
    assert b" "[0] == 32 and " ".encode()[0] == 32
