"""The CUDA lowering registry, the kernel files the op families declare, and the constants
the host shares with the kernels."""
import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.gguf import blocks
from toygraph.ops.gemm import cuda as matmul_ops
from toygraph.ops.lowering import constants, dispatch, registry, sources
from toygraph.ops.lowering.constants import DEFINES
from toygraph.ops.lowering.sources import backend_source, source_files
from toygraph.errors import CudaError

OPS_DIR = Path(ops.__file__).parent


# --- constants defined once ------------------------------------------------------------------
@pytest.mark.parametrize("source", [backend_source("f32"), backend_source("bf16")],
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
    assert registry.op_kernels() == {op: e.kernels for op, e in registry.REGISTRY.items()}
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
        dispatch.lower(Node(), lambda t: 0)
    with pytest.raises(CudaError, match="'frobnicate'"):
        dispatch.scratch_bytes(Node())


def test_each_op_lives_in_one_family_folder():
    """One op, one place: every op of the op table has its rules, a numpy kernel and a CUDA
    lowering, in the one family folder of toygraph/ops: <family>/__init__.py (the rules),
    numpy.py and cuda.py (or a CUDA-only cuda_*.py helper beside it)."""
    assert set(ops.KERNELS) == set(ops.OPS) == set(registry.REGISTRY)
    for op in ops.OPS:
        family, _, half = ops.KERNELS[op].__module__.rpartition(".")
        assert family.startswith("toygraph.ops.") and family.count(".") == 2, (op, family)
        assert half == "numpy", op
        assert registry.REGISTRY[op].build.__module__.startswith(family + ".cuda"), op


# --- the kernel files: declared by the families, never listed by hand -------------------------
def test_every_kernel_file_beside_the_ops_is_declared_by_the_family_beside_it():
    """The .cu files of toygraph/ops/<family>/ are exactly the declared ones, each declared
    by the cuda.py beside it, and the family headers of include/ are declared too (so a new
    family's file cannot be forgotten)."""
    on_disk = {p.name for p in OPS_DIR.glob("*/*.cu")}
    headers = {p.name for p in (OPS_DIR / "include").glob("*.cuh")} - set(sources.HEADERS)
    assert on_disk | headers == set(sources.FILES)
    declaring = {}
    for module in OPS_DIR.glob("*/cuda.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "declare_kernels":
                for arg in node.args[1:]:
                    declaring[arg.value] = module.parent
    assert set(declaring) == on_disk | headers, declaring
    for name, folder in declaring.items():
        f = sources.FILES[name]
        assert f.path.parent == (OPS_DIR / "include" if name.endswith(".cuh") else folder), name


def test_the_modules_order_files_by_what_they_need():
    f32, bf16 = sources.files_of("f32"), sources.files_of("bf16")
    assert f32.index("matmul.cu") < f32.index("qmatmul.cu")
    assert bf16.index("tc_layout.cuh") < bf16.index("tc_matmul.cu")
    assert "tc_matmul.cu" not in f32 and set(f32) < set(bf16)
    assert sources.only_in("bf16") == sources.only_in("tf32")
    assert set(sources.only_in("bf16")) == {"tc_layout.cuh", "tc_matmul.cu", "tc_async.cuh",
                                            "tc_attention.cu", "tc_gemm.cu"}
    assert bf16.index("tc_attention.cu") > max(bf16.index(n) for n in (
        "flash_attention.cu", "tc_matmul.cu", "tc_async.cuh"))
    assert bf16.index("tc_gemm.cu") > max(bf16.index(n) for n in ("tc_matmul.cu", "tc_async.cuh"))
    src = backend_source("f32")
    assert src.index("// ---- matmul.cu") < src.index("// ---- qmatmul.cu")


def test_a_kernel_file_declared_twice_or_missing_is_refused(tmp_path):
    with pytest.raises(CudaError, match="declared twice"):
        sources.declare_kernels(matmul_ops.__file__, "matmul.cu")
    with pytest.raises(CudaError, match="does not exist"):
        sources.declare_kernels(str(tmp_path / "fam.py"), "nothing.cu")
    with pytest.raises(CudaError, match="not declared"):
        sources.module_source(("nothing.cu",))


def test_the_lowering_api_is_all_the_families_import_from_cuda():
    """Op families use the public toygraph.ops.lowering API (and its constants), never the
    runtime or a private helper; the lowering package imports no op family."""
    for module in OPS_DIR.glob("*/cuda*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("toygraph.cuda", "toygraph.ops.lowering")):
                assert node.module in ("toygraph.ops.lowering", "toygraph.ops.lowering.constants"), \
                    (module.name, node.module)
                assert not any(a.name.startswith("_") for a in node.names), (module.name, node.module)
    lowering = Path(registry.__file__).parent
    for module in lowering.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("toygraph.core") for n in names), (module.name, names)


def test_every_block_format_with_a_decoder_can_stay_on_the_device():
    assert registry.block_storage() == blocks.BLOCK_FORMATS
    with pytest.raises(CudaError, match="no CUDA dequantizer for storage 'q9_9'"):
        registry.decode_launch("w", "q9_9", 0, 0, 1)
