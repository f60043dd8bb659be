"""What the lowerings know of the GPU they lower for: its count of streaming
multiprocessors, which split-K fills (ops/gemm/cuda_tc.py) and the bf16 cost model divides
the work over. The CUDA runtime says it when a backend opens its device
(cuda/backend.py: the driver's CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT; the host
executor stands in for an H100/H200 SXM's 132), before anything is lowered.

A product's split count is a function of its shape and this count, so a step is
bit-identical run to run on one kind of GPU; another GPU may split (and so round) its
weight gradients differently, as it would with any tuned GEMM library.
"""
from __future__ import annotations

from toygraph.errors import CudaError

#: The count until a backend says otherwise: an H100/H200 SXM's (the host executor's too).
DEFAULT_SM_COUNT = 132
_sm_count = DEFAULT_SM_COUNT


def sm_count() -> int:
    """The SMs of the GPU being lowered for."""
    return _sm_count


def use_sm_count(n: int) -> None:
    """Lower for a GPU with ``n`` SMs (the runtime's call, when it opens a device)."""
    global _sm_count
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
        raise CudaError(f"a GPU's SM count must be an integer in [1, 4096], got {n!r}")
    _sm_count = n
