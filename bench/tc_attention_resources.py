"""What ptxas reports for the tensor-core attention kernels (toygraph/core/ops/tc_attention.cu)
compiled with NVRTC for sm_80 and sm_90 (no GPU needed): registers, static shared memory,
stack and spills per kernel, and the f32 attention kernels' for comparison. Compile-time
facts, not timings.

    python bench/tc_attention_resources.py [--json]
"""
from __future__ import annotations

import argparse
import json

from toygraph.core import ops  # noqa: F401  (the op families declare their kernel files)
from toygraph.cuda.lowering.sources import module_source
from toygraph.cuda.nvrtc import resource_usage

FILES = ("flash_attention.cu", "tc_layout.cuh", "tc_matmul.cu", "tc_async.cuh",
         "tc_attention.cu")


def report() -> dict[str, dict[str, dict]]:
    out = {}
    for arch in ("sm_80", "sm_90"):
        usage = resource_usage(module_source(FILES), arch, name="tc_attention.cu")
        out[arch] = {k: v for k, v in sorted(usage.items())
                     if k.startswith(("tg_tca_", "tg_attn_"))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print_report(report(), args.json)


def print_report(rep: dict, as_json: bool = False) -> None:
    """``rep`` (arch -> kernel -> ptxas usage) as JSON or as a markdown table."""
    if as_json:
        print(json.dumps(rep, indent=1))
        return
    print("| arch | kernel | registers | smem bytes | stack | spill stores/loads |")
    print("|---|---|---|---|---|---|")
    for arch, kernels in rep.items():
        for name, u in kernels.items():
            print(f"| {arch} | {name} | {u['registers']} | {u['smem']} | {u['stack']} | "
                  f"{u['spill_stores']}/{u['spill_loads']} |")


if __name__ == "__main__":
    main()
