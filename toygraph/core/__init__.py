"""The graph core: tensors and ops, autodiff, the in-graph optimizer, activation
recomputation, the buffer plan, the session, and the numpy backend.

Nothing here knows a model, a file format beyond the GGUF block formats a const may be
stored in, or a training run. The layers above build graphs with it; the CUDA backend
(toygraph.cuda) sits above it and registers itself as the second runtime the session can
drive (backends.py), so nothing here imports it.
"""
