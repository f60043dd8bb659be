"""The CUDA lowering registry and the constants the host shares with the kernels."""
import inspect
import re
import sys

import pytest

from toygraph import ops
from toygraph.cuda import constants, lowering, registry
from toygraph.cuda.constants import DEFINES
from toygraph.cuda.kernels import backend_source, module_source, source_files
from toygraph.errors import CudaError
from toygraph.ops import gemm as matmul_ops


# --- constants defined once ------------------------------------------------------------------
@pytest.mark.parametrize("source", [module_source(), backend_source("bf16")],
                         ids=["f32", "bf16"])
def test_every_shared_constant_is_emitted_once_into_the_kernel_source(source):
    for name, value in DEFINES.items():
        found = re.findall(rf"^#define {name} (\S+)$", source, re.M)
        assert found == [str(value)], (name, found)


def test_no_kernel_source_restates_a_shared_constant():
    files = source_files()
    assert len(files) >= 10
    for f in files:
        text = f.read_text()
        for name in DEFINES:
            assert not re.search(rf"#\s*define\s+{name}\b", text), (f.name, name)


def test_the_tile_shapes_the_kernels_assume():
    """matmul.cu/qmatmul.cu: 16 x 16 threads of 4 x 4 outputs, each staging 4 elements of
    each operand tile per k slice; the launches use square tiles."""
    c = constants
    assert c.MM_BM == c.MM_BN and c.TC_BM == c.TC_BN == matmul_ops.TC_TILE
    assert c.MM_THREADS == (c.MM_BM // 4) * (c.MM_BN // 4) == 256
    assert 4 * c.MM_THREADS == c.MM_BK * c.MM_BM == c.MM_BK * c.MM_BN
    assert c.TC_MI * 16 == c.TC_WM and c.TC_NI * 8 == c.TC_WN
    assert c.ATTN_HEAD_DIMS == tuple(sorted(constants.ATTN_TILES))


# --- the registry ------------------------------------------------------------------------------
def test_every_op_has_one_registry_entry():
    assert set(registry.REGISTRY) == set(ops.OPS)
    assert lowering.OP_KERNELS == {op: e.kernels for op, e in registry.REGISTRY.items()}
    with pytest.raises(CudaError, match="op 'add' has two CUDA lowerings"):
        registry.lowers("add", kernels=("tg_binary",))(lambda node, at: [])


def test_every_kernel_name_is_written_out_in_its_family_module():
    """Searching for a kernel's name finds the module that lowers to it."""
    for op, entry in registry.REGISTRY.items():
        module = sys.modules[entry.build.__module__]
        text = inspect.getsource(module)
        for name in entry.kernels:
            assert f'"{name}"' in text, (op, name, module.__name__)


def test_a_missing_lowering_is_a_clear_error_naming_the_op():
    class Node:
        op, name, srcs = "frobnicate", "x7", ()
    with pytest.raises(CudaError, match="no lowering for op 'frobnicate' \\(node 'x7'\\)"):
        lowering.lower(Node(), lambda t: 0)
    with pytest.raises(CudaError, match="'frobnicate'"):
        lowering.scratch_bytes(Node())


def test_each_op_lives_in_one_family_module():
    """One op, one place: every op of the op table has a numpy kernel and a CUDA lowering,
    and both are defined in the same family module of toygraph.ops (with its rules)."""
    assert set(ops.KERNELS) == set(ops.OPS) == set(registry.REGISTRY)
    for op in ops.OPS:
        module = ops.KERNELS[op].__module__
        assert module.startswith("toygraph.ops.") and module != "toygraph.ops.table", op
        assert registry.REGISTRY[op].build.__module__ == module, op
