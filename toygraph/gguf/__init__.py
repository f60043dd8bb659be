"""The GGUF file: the bounded reader, the file's metadata and tensors, the block formats
(decode and encode), and the tokenizer and chat template a file carries.

This is the lowest layer above errors and environment: it knows the container and its
encodings, nothing about decoder families (toygraph.models reads a file as a model).
"""


def __getattr__(name):
    """``toygraph.gguf.GGUFModel`` and ``open_gguf`` of toygraph 0.1, for one release: a
    GGUF read as a decoder is toygraph.models.model's now."""
    if name in ("GGUFModel", "open_gguf"):
        from toygraph import moved
        moved.warn_moved(f"toygraph.gguf.{name}", f"toygraph.models.model.{name}")
        from toygraph.models import model   # deprecated alias: the one import up the layers
        return getattr(model, name)
    raise AttributeError(f"module 'toygraph.gguf' has no attribute {name!r}")
