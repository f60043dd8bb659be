"""Decoder models: a model as a list of layers made of parts (parts.py), the families as
prototypes of those layers (families.py), the list read from a GGUF (config.py, with the
part readers in readers.py), a GGUF read as a decoder (model.py), the one decoder builder
(decoder.py) and the parts' builders (block.py: attention.py, deltanet.py, ffn.py,
moe.py; sequence.py), and models by name (catalog.py) or from other programs' stores
(stores.py).

>>> from toygraph.models import GGUFModel
>>> model = GGUFModel("SmolLM2-135M-Instruct.Q4_1.gguf")      # doctest: +SKIP
"""
from toygraph.models.config import ModelConfig  # noqa: F401
from toygraph.models.model import GGUFModel, open_gguf  # noqa: F401
