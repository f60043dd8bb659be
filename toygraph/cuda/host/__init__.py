"""The host device: the CUDA kernels compiled by g++ against a small shim (host_shim.h: a fiber
per CUDA thread, barriers, warp shuffles, atomics, mma.sync) and run on the CPU, driven by
the unchanged CUDA backend (``TOYGRAPH_CUDA_DEVICE=host``). CI checks every kernel with it.
"""
