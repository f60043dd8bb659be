"""toygraph: fine-tune Llama-family models straight from GGUF files.

A small tensor-graph DSL builds the whole training step once; a Session realizes it on a
backend (numpy on the CPU, NVRTC-compiled kernels on CUDA) and replays it every step.
"""
from toygraph.errors import CudaError, DataError, GGUFError, GraphError, ToygraphError

__version__ = "0.2.0"
__all__ = ["ToygraphError", "GraphError", "GGUFError", "DataError", "CudaError", "__version__"]
