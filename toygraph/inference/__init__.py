"""Using a model: ``LanguageModel`` (loss, generation over a KV cache, with or without an
adapter), the KV-cache decoder, token sampling and the chat loop.

>>> from toygraph.inference import LanguageModel                # doctest: +SKIP
>>> LanguageModel("model.gguf").generate("Hello", max_new_tokens=8)   # doctest: +SKIP
"""


def __getattr__(name):
    # LanguageModel on first use: importing a light module of this package (sampling,
    # chat) must not import the whole model stack.
    if name == "LanguageModel":
        from toygraph.inference.language_model import LanguageModel
        return LanguageModel
    raise AttributeError(f"module 'toygraph.inference' has no attribute {name!r}")
