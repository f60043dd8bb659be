"""Earlier name of the decoder builder, kept for existing callers (benchmarks, CUDA tests).

Every family is built by models/decoder.py; ``build_llama`` is ``build_decoder``.
"""
from .decoder import (TARGETS, WEIGHT_MODES, Decoder, LoraConfig, build_decoder, lm_head,  # noqa: F401
                      weight_names, weight_shape)

build_llama = build_decoder
Llama = Decoder
