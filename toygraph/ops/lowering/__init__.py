"""The CUDA lowering API: what an op family writes to run its ops on CUDA.

An op family (a module of ``toygraph.ops``) holds, beside each op's rules and numpy
kernel, its CUDA side, written against this API only:

- ``declare_kernels(__file__, "norm.cu")``: the family's kernel files, beside its module
  (``needs=`` files whose helpers they use, ``precisions=`` the modules they belong to);
  the backends compile every declared file (sources.py), so the list is never kept by hand.
- ``@lowers("rms_norm", kernels=("tg_rms_norm",), scratch=..., block_format=...)`` on a
  function ``build(node, at) -> [Launch, ...]``: how one node runs. ``at`` (:class:`At`)
  gives its output and operand addresses, its scratch, the matmul precision and the kernels
  the entry declares.
- ``@decodes(*formats)`` on ``launch(name, storage, out, raw, n)``: how a const stored in a GGUF
  block format is decoded to f32 on the device (the gemm family's dequantizers).
- :class:`Launch` (a kernel, its grid, block, shared memory and arguments) and
  :class:`Collective` (an all-reduce on the stream); arguments are fixed-width numpy values
  made by ``ptr_arg`` (a pointer), ``i32_arg``, ``f32_arg``, ``f64_arg`` (named apart
  from the graph's dtypes ``F32``/``I32``) and ``strided`` (the ``Strided``
  struct of include/common.cuh, from ``contiguous_strides``); grids by ``grid_1d(n)``,
  ``rows_grid(rows)``, with ``pad_shape`` and ``last_axis_rows`` for shapes.
- :data:`FORMAT_KERNELS`: the kernels a .cu file defines once per block format (its
  ``TG_BLOCK_FORMATS(M)`` lines), spelled out by pattern and format:
  ``FORMAT_KERNELS["tg_qmm_nt_<fmt>"]["q4_k"]`` is ``"tg_qmm_nt_q4_k"`` (format_kernels.py,
  written by ``python -m toygraph.ops.lowering.generate``).
- :func:`sm_count`: the SMs of the GPU being lowered for (device.py; what split-K fills).
- :mod:`constants`: the numbers kernels and launches share (``THREADS``, the matmul and
  attention tiles), emitted into every module as ``#define``s.

>>> from toygraph.ops.lowering import Launch, f32_arg, grid_1d, i32_arg, lowers, ptr_arg
>>> @lowers("my_scale", kernels=("tg_scale",))                     # doctest: +SKIP
... def _my_scale(node, at):
...     x = node.srcs[0]
...     return [Launch("tg_scale", grid_1d(node.size),
...                    [ptr_arg(at.out), ptr_arg(at.ptr(x)), i32_arg(node.size),
...                     f32_arg(node.attrs["s"])])]

The CUDA runtime (toygraph.cuda.backend, devmem.py) looks nodes up through dispatch.py;
nothing here imports an op family, and the families import nothing of the runtime.
"""
from toygraph.ops.lowering import constants  # noqa: F401
from toygraph.ops.lowering.device import sm_count  # noqa: F401
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS  # noqa: F401
from toygraph.ops.lowering.launch import (MAX_ELEMENTS, MAX_GRID, MAX_GRID_YZ, THREADS, Collective,  # noqa: F401
                                          Launch, contiguous_strides, f32_arg, f64_arg, grid_1d,  # noqa: F401
                                          i32_arg, last_axis_rows, pad_shape, ptr_arg, rows_grid,  # noqa: F401
                                          strided)  # noqa: F401
from toygraph.ops.lowering.registry import At, decodes, lowers  # noqa: F401
from toygraph.ops.lowering.sources import declare_kernels  # noqa: F401
