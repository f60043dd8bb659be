"""The bf16 module -- every kernel: the f32 files and the tensor-core ones -- compiled once
per arch with ptxas's report, for the tests that check a cubin's symbols or a kernel's
registers, shared memory and spills. ptxas compiles each kernel alone, so its figures in
the whole module are those of a file compiled by itself, and one compile (~90 s for sm_90
here) serves every such test instead of one per test."""
from __future__ import annotations

import functools

import pytest

#: The archs the compile checks run for: sm_90 (the H200 the device tool lends) in the
#: default run; sm_80 adds a second full compile of each module (~90 s and ~25 s), so it
#: runs in the slow tier (-m slow).
ARCHS = ["sm_90", pytest.param("sm_80", marks=pytest.mark.slow)]


@functools.cache
def bf16_module(arch: str) -> tuple[bytes, dict[str, dict]]:
    """(cubin, nvrtc.resource_usage-style report) of backend_source("bf16") for ``arch``."""
    import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
    from toygraph.ops.lowering.sources import backend_source
    from toygraph.cuda.nvrtc import compile_report
    return compile_report(backend_source("bf16"), arch, name="toygraph_tc.cu")
