"""The arithmetic a session computes with: its backend and the matmuls' input precision.

Kept apart from session.py so both backends can name the precisions without importing the
session that makes them.
"""
from __future__ import annotations

#: The backends a Session runs on: numpy ("cpu") and NVRTC-compiled kernels ("cuda").
BACKENDS = ("cpu", "cuda")
#: Matmul input precisions: "f32" on every backend; "bf16" / "tf32" run every matmul on
#: CUDA tensor cores (f32 accumulation; every buffer, master weight and moment stays f32).
TENSOR_CORE_PRECISIONS = ("bf16", "tf32")
PRECISIONS = ("f32",) + TENSOR_CORE_PRECISIONS


def precision_error(precision: str, backend: str) -> str | None:
    """Why ``precision`` cannot run on ``backend``, as the end of a sentence; None if it can."""
    if precision not in PRECISIONS:
        return f"must be one of {', '.join(PRECISIONS)}, got {precision!r}"
    if precision != "f32" and backend != "cuda":
        return (f"{precision!r} (tensor-core matmuls, f32 everything else) needs the cuda "
                f"backend, got {backend!r}")
    return None
