"""Using a model: ``LanguageModel`` (loss, generation over a KV cache, with or without an
adapter), the KV-cache decoder, token sampling and the chat loop.

>>> from toygraph.inference import LanguageModel                # doctest: +SKIP
>>> LanguageModel("model.gguf").generate("Hello", max_new_tokens=8)   # doctest: +SKIP
"""
from toygraph.inference.language_model import LanguageModel  # noqa: F401
