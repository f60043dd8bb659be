"""A decoder GGUF (any family of models/families.py) read as a model: its config (the list
of layers) from the metadata, checked against the family, and every tensor the graph
needs present.

>>> m = GGUFModel("SmolLM2-135M-Instruct.Q4_1.gguf")      # doctest: +SKIP
>>> m.config.n_layer, m.tensor("blk.0.attn_q.weight").shape  # doctest: +SKIP
(30, (576, 576))
"""
from __future__ import annotations

import os

from toygraph.errors import GGUFError
from toygraph.gguf.file import GGUFFile, WeightTensor  # noqa: F401 (WeightTensor: re-exported)
from toygraph.models.config import ModelConfig, check_tensors, read_config


class GGUFModel(GGUFFile):
    """A decoder GGUF, validated at open: config, required tensors, types, bounds.

    >>> m = GGUFModel("tiny.gguf")                   # doctest: +SKIP
    >>> w = m.tensor("blk.0.ffn_up.weight")          # doctest: +SKIP
    >>> w.qtype, w.shape, w.dequantize().dtype       # doctest: +SKIP
    ('q8_0', (96, 64), dtype('float32'))
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.config: ModelConfig = read_config(self.metadata, list(self.reader.fields),
                                               self._shapes, self.path)
        # Every tensor the graph needs, with its shape, and no tensor it would ignore.
        check_tensors(self.config, self._shapes, self.path)
        self._check_vocabulary()

    def _check_vocabulary(self) -> None:
        """The vocabulary's sizes agree: ``<arch>.vocab_size`` (when present) with the
        embedding rows, and no more tokens than rows (a token id past the embedding would
        read another tensor's bytes). Fewer tokens than rows is padding, as Qwen's files
        have."""
        rows = self.config.n_vocab
        said = self.metadata(f"{self.config.arch}.vocab_size")
        if said is not None and said != rows:
            raise GGUFError(f"{self.path}: {self.config.arch}.vocab_size is {said}, but "
                            f"token_embd.weight has {rows} rows")
        field = self.reader.get_field("tokenizer.ggml.tokens")
        n_tokens = len(field.data) if field is not None else 0
        if n_tokens > rows:
            raise GGUFError(f"{self.path}: tokenizer.ggml.tokens lists {n_tokens} tokens, but "
                            f"token_embd.weight has only {rows} rows")

    def __repr__(self) -> str:
        return f"GGUFModel({str(self.path)!r}, {self.config})"


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and validate a decoder GGUF file (see GGUFModel)."""
    return GGUFModel(path)
