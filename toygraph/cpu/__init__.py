"""The CPU engine: native kernels that compute on GGUF blocks (decoders, products by
panels, row dots for generation) and the one pool of threads they and BLAS share.

- ``engine``: the library (engine.cpp and its headers, built by toygraph/native.py) and its
  Python entry points; the numpy path when no compiler is present.
- ``threads``: ``--threads``, ``$TOYGRAPH_THREADS`` or the CPUs this process may use, set
  for the engine's pool and BLAS's.
- ``block_tensor``: a frozen tensor kept as its block bytes, decoded or multiplied by the
  engine.
"""
