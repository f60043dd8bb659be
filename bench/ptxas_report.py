"""What ptxas reports for the CUDA kernels, compiled with NVRTC for sm_80 and sm_90 (no GPU
needed): registers, static shared memory, stack and spills per kernel. Compile-time facts,
not timings. Blocks per SM: 65536 registers / (registers x threads), and 228 KB of shared
memory / smem bytes (sm_80: 164 KB), the smaller.

The report is the one the tests check (tests/support/ptxas.py: the whole bf16 module, every
kernel, compiled once per arch; ptxas compiles each kernel alone, so a kernel's figures are
those of its file compiled by itself). ``--kernels`` picks them by name prefix, or by one of
the groups below:

    python bench/ptxas_report.py --kernels attention        # tc_attention.cu, f32 attention
    python bench/ptxas_report.py --kernels gemm --json      # tc_gemm.cu and the matmuls it replaces
    python bench/ptxas_report.py --kernels tg_rms_norm,tg_glu --arch sm_90
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.ptxas import bf16_module  # noqa: E402

#: Named sets of kernel-name prefixes.
GROUPS = {
    # the tensor-core attention kernels, and the f32 ones for comparison
    "attention": ("tg_tca_", "tg_attn_"),
    # the bf16 GEMM, and the tensor-core matmuls it replaces at bf16 (one block format's)
    "gemm": ("tg_tcg_", "tg_tc_matmul_", "tg_tc_qmm_nt_q4_k_bf16", "tg_tc_qmm_nn_q4_k_bf16"),
}


def report(prefixes: tuple[str, ...], archs=("sm_80", "sm_90")) -> dict[str, dict[str, dict]]:
    """arch -> kernel -> ptxas usage, for the kernels whose names start with ``prefixes``."""
    return {arch: {k: v for k, v in sorted(bf16_module(arch)[1].items())
                   if k.startswith(prefixes)} for arch in archs}


def markdown(rep: dict) -> str:
    lines = ["| arch | kernel | registers | smem bytes | stack | spill stores/loads |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {arch} | {name} | {u['registers']} | {u['smem']} | {u['stack']} | "
              f"{u['spill_stores']}/{u['spill_loads']} |"
              for arch, kernels in rep.items() for name, u in kernels.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="attention",
                    help=f"a group ({', '.join(GROUPS)}) or comma-separated name prefixes")
    ap.add_argument("--arch", default="sm_80,sm_90", help="comma-separated (default both)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    prefixes = GROUPS.get(a.kernels) or tuple(p for p in a.kernels.split(",") if p)
    rep = report(prefixes, tuple(a.arch.split(",")))
    if not any(rep.values()):
        ap.error(f"no kernel starts with {', '.join(prefixes)}")
    print(json.dumps(rep, indent=1) if a.json else markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
