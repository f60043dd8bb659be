"""The CUDA C++ sources of every toygraph kernel, assembled into one module.

The kernels live in ``kernels/*.cu`` by family (elementwise, row-wise, matmul, loss,
optimizer, dequantization) with shared helpers in ``kernels/common.cuh``. They need no
CUDA toolkit header, so NVRTC compiles them with nothing but its own wheel. The backend
compiles :func:`module_source` once (cached on disk by nvrtc.py) and looks kernels up by
name.

>>> from toygraph.cuda.kernels import KERNEL_NAMES, module_source
>>> "tg_matmul" in KERNEL_NAMES and "tg_deq_q6_k" in KERNEL_NAMES
True
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

KERNEL_DIR = Path(__file__).with_name("kernels")
HEADER = "common.cuh"
FAMILIES = ("elementwise.cu", "rows.cu", "matmul.cu", "loss.cu", "optim.cu", "dequant.cu")

#: The kernels each op of ops.OPS lowers to (see lowering.py); tests check the table is
#: complete and every name exists in the sources.
OP_KERNELS: dict[str, tuple[str, ...]] = {
    "add": ("tg_binary",), "sub": ("tg_binary",), "mul": ("tg_binary",),
    "scale": ("tg_scale",), "silu": ("tg_silu",), "silu_back": ("tg_silu_back",),
    "sum_to": ("tg_reduce_block", "tg_reduce_thread"), "expand": ("tg_gather",),
    "rms_norm": ("tg_rms_norm",), "rms_norm_back": ("tg_rms_norm_back",),
    "rope": ("tg_rope",), "softmax": ("tg_softmax",), "softmax_back": ("tg_softmax_back",),
    "matmul": ("tg_matmul",),
    "reshape": ("tg_copy",), "contiguous": ("tg_copy",), "permute": ("tg_gather",),
    "sum": ("tg_reduce_block", "tg_reduce_thread"),
    "get_rows": ("tg_get_rows",), "get_rows_back": ("tg_fill", "tg_get_rows_back"),
    "cross_entropy": ("tg_ce_rows", "tg_ce_reduce"), "cross_entropy_back": ("tg_ce_back",),
    "count_valid": ("tg_count_valid",),
    "accumulate": ("tg_accumulate",),
    "global_norm": ("tg_sumsq_partial", "tg_global_norm"),
    "adamw": ("tg_adamw",),
}

#: Dequantization kernel per const storage format (f32 consts are uploaded as they are).
DEQUANT_KERNELS: dict[str, str] = {
    "f16": "tg_deq_f16", "bf16": "tg_deq_bf16", "q8_0": "tg_deq_q8_0", "q4_0": "tg_deq_q4_0",
    "q4_1": "tg_deq_q4_1", "q4_k": "tg_deq_q4_k", "q5_k": "tg_deq_q5_k", "q6_k": "tg_deq_q6_k",
}


def read_source(name: str) -> str:
    return (KERNEL_DIR / name).read_text()


@lru_cache(maxsize=None)
def module_source(families: tuple[str, ...] = FAMILIES) -> str:
    """The header followed by the given kernel families: one translation unit."""
    parts = [f"// ---- {HEADER}\n" + read_source(HEADER)]
    parts += [f"// ---- {f}\n" + read_source(f) for f in families]
    return "\n".join(parts)


def kernel_names(source: str) -> list[str]:
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)',
                      source)


KERNEL_NAMES: tuple[str, ...] = tuple(kernel_names(module_source()))
