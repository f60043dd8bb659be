"""What ptxas reports for the bf16 GEMM (toygraph/core/ops/tc_gemm.cu) and, for comparison,
the tensor-core matmuls it replaces at bf16 (tc_matmul.cu's tg_tc_matmul_*, and one of
the block-format kernels), compiled with NVRTC for sm_80 and sm_90 (no GPU needed):
registers, static shared memory, stack and spills per kernel. Compile-time facts, not
timings. Blocks per SM: 65536 registers / (registers x 256 threads), and 228 KB of
shared memory / smem bytes (sm_80: 164 KB), the smaller.

    python bench/tc_gemm_resources.py [--json]
"""
from __future__ import annotations

import argparse

from tc_attention_resources import print_report
from toygraph.core import ops  # noqa: F401  (the op families declare their kernel files)
from toygraph.cuda.lowering.sources import module_source
from toygraph.cuda.nvrtc import resource_usage

FILES = ("tc_layout.cuh", "tc_matmul.cu", "tc_async.cuh", "tc_gemm.cu")
SHOWN = ("tg_tcg_", "tg_tc_matmul_", "tg_tc_qmm_nt_q4_k_bf16", "tg_tc_qmm_nn_q4_k_bf16")


def report() -> dict[str, dict[str, dict]]:
    out = {}
    for arch in ("sm_80", "sm_90"):
        usage = resource_usage(module_source(FILES), arch, name="tc_gemm.cu")
        out[arch] = {k: v for k, v in sorted(usage.items()) if k.startswith(SHOWN)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    print_report(report(), ap.parse_args().json)


if __name__ == "__main__":
    main()
