"""The CUDA runtime: the driver, NVRTC, device memory, the backend and the host executor.
Loading the package loads every op family's CUDA lowering (lowerings.py)."""
from toygraph.cuda import lowerings  # noqa: F401
