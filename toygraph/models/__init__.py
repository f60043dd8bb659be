"""Decoder models: the families as data (families.py), the config read from a GGUF
(config.py), a GGUF read as a decoder (model.py), the one decoder builder (decoder.py) and
models by name (catalog.py).

>>> from toygraph.models import GGUFModel
>>> model = GGUFModel("SmolLM2-135M-Instruct.Q4_1.gguf")      # doctest: +SKIP
"""
from toygraph.models.config import ModelConfig  # noqa: F401
from toygraph.models.model import GGUFModel, open_gguf  # noqa: F401
