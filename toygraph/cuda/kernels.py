"""The CUDA C++ sources of every toygraph kernel, assembled into one module.

Each op family's kernels sit beside its Python module in ``toygraph/ops/<family>.cu``
(the matmul family has several: matmul.cu, qmatmul.cu, dequant.cu and the tensor-core
tc_layout.cuh + tc_matmul.cu); the helpers every kernel shares are the headers of
``toygraph/cuda/include/`` (common.cuh; quant.cuh, the block-format decoders). Numbers the
host and the kernels share are emitted ahead of them as ``#define``s: the tile sizes and
thread counts of constants.py (:func:`constants.constant_defines`) and the block layouts of
quant.LAYOUT (:func:`layout_defines`). Which op launches which kernels is each op's entry
in the lowering registry (registry.py), declared in its family module. The kernels need no
CUDA toolkit header, so NVRTC compiles them with nothing but its own wheel. The backend
compiles :func:`module_source` once (cached on disk by nvrtc.py) and looks kernels up by
name; a backend with dtype "bf16"/"tf32" compiles :func:`backend_source`, which adds the
tensor-core matmuls (TC_FAMILIES, TC_KERNELS).

>>> from toygraph.cuda.kernels import KERNEL_NAMES, module_source
>>> "tg_matmul" in KERNEL_NAMES and "tg_deq_q6_k" in KERNEL_NAMES
True
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

# ATTN_HEAD_DIMS: the attention kernels' head_dim bounds, importable from here as before.
from .constants import ATTN_HEAD_DIMS, constant_defines  # noqa: F401

#: The shared headers, and the folder of the op families' sources (toygraph/ops/).
INCLUDE_DIR = Path(__file__).with_name("include")
OPS_DIR = Path(__file__).parent.parent / "ops"
HEADERS = ("common.cuh", "quant.cuh")
#: The op families' kernel files, in toygraph/ops/. qmatmul.cu reuses matmul.cu's tile
#: helper (tg_mm_tile_fma): keep it after matmul.cu.
FAMILIES = ("shape.cu", "elementwise.cu", "norm.cu", "rotary.cu", "matmul.cu",
            "qmatmul.cu", "dequant.cu", "rows.cu", "loss.cu", "optim.cu", "flash_attention.cu",
            "preference.cu", "cache.cu")
#: The tensor-core matmuls of the mixed-precision modes, compiled only for a backend with
#: dtype "bf16" or "tf32" so the default f32 module (and its cubin) stays as it is.
TC_FAMILIES = ("tc_layout.cuh", "tc_matmul.cu")
#: Backend dtypes whose matmuls run on tensor cores (the rest of the step stays f32).
TC_PRECISIONS = ("bf16", "tf32")

#: Dequantization kernel per const storage format (f32 consts are uploaded as they are).
DEQUANT_KERNELS: dict[str, str] = {
    fmt: f"tg_deq_{fmt}" for fmt in ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
                                     "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
}

#: Kernels that read a const in its block format (qmatmul.cu), per storage format:
#: "nt" y = x @ W^T, "nn" dx = dy @ W, "rows" get_rows from a block-format table.
QUANT_KERNELS: dict[str, dict[str, str]] = {
    fmt: {"nt": f"tg_qmm_nt_{fmt}", "nn": f"tg_qmm_nn_{fmt}", "rows": f"tg_get_rows_{fmt}"}
    for fmt in DEQUANT_KERNELS
}


#: Tensor-core kernels per precision: "matmul" takes tg_matmul's arguments, "nt"/"nn" per
#: block format take the fused kernels' (QUANT_KERNELS) arguments.
TC_KERNELS: dict[str, dict] = {
    prec: {"matmul": f"tg_tc_matmul_{prec}",
           "nt": {fmt: f"tg_tc_qmm_nt_{fmt}_{prec}" for fmt in DEQUANT_KERNELS},
           "nn": {fmt: f"tg_tc_qmm_nn_{fmt}_{prec}" for fmt in DEQUANT_KERNELS}}
    for prec in TC_PRECISIONS
}


def source_path(name: str) -> Path:
    """Where kernel source ``name`` lives: a shared header in include/, else toygraph/ops/."""
    return (INCLUDE_DIR if name in HEADERS else OPS_DIR) / name


def source_files() -> list[Path]:
    """Every kernel source file: the headers, the families and the tensor-core files."""
    return [source_path(name) for name in HEADERS + FAMILIES + TC_FAMILIES]


def read_source(name: str) -> str:
    return source_path(name).read_text()


def layout_defines() -> str:
    """quant.BLOCK and quant.LAYOUT as C macros (``TG_Q4_K_QK``, ``TG_Q4_K_BYTES``,
    ``TG_Q4_K_SCALES``...) and quant.IQ4NL_VALUES as ``TG_IQ4NL_VALUES``, so the kernels
    use the one description of each block."""
    from .. import quant
    lines = ["// generated from toygraph.quant.BLOCK, LAYOUT and IQ4NL_VALUES",
             f"#define TG_IQ4NL_VALUES {', '.join(map(str, quant.IQ4NL_VALUES))}"]
    for fmt in DEQUANT_KERNELS:
        elems, size = quant.BLOCK[fmt]
        name = fmt.upper()
        lines += [f"#define TG_{name}_QK {elems}", f"#define TG_{name}_BYTES {size}"]
        lines += [f"#define TG_{name}_{field.upper()} {off}"
                  for field, off in quant.LAYOUT.get(fmt, {}).items()]
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=None)
def module_source(families: tuple[str, ...] = FAMILIES) -> str:
    """The shared constants and block layouts as macros, the headers, then the given kernel
    families: one translation unit."""
    parts = ["// ---- constants\n" + constant_defines(),
             "// ---- quant layout\n" + layout_defines()]
    parts += [f"// ---- {h}\n" + read_source(h) for h in HEADERS]
    parts += [f"// ---- {f}\n" + read_source(f) for f in families]
    return "\n".join(parts)


def kernel_names(source: str) -> list[str]:
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)',
                      source)


def backend_source(precision: str = "f32") -> str:
    """The module a backend of this precision compiles: f32 exactly :func:`module_source`,
    bf16/tf32 that plus the tensor-core kernels."""
    return module_source() if precision == "f32" else module_source(FAMILIES + TC_FAMILIES)


KERNEL_NAMES: tuple[str, ...] = tuple(kernel_names(module_source()))
TC_KERNEL_NAMES: tuple[str, ...] = tuple(kernel_names(module_source(TC_FAMILIES)))
