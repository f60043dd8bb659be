"""Random LoRA adapters for the adapter-file tests."""
import numpy as np

from toygraph.models.decoder import TARGETS, weight_shape


def random_lora(cfg, targets=tuple(TARGETS), rank=4, seed=0, scale=1.0):
    """{GGUF weight: (A [rank, n_in], B [n_out, rank])} for every layer's ``targets``,
    standard normal draws times ``scale`` (A then B, layer by layer, target by target)."""
    rng = np.random.default_rng(seed)
    lora = {}
    for i in range(cfg.n_layer):
        for t in targets:
            name = f"blk.{i}.{TARGETS[t]}.weight"
            n_out, n_in = weight_shape(cfg, name)
            lora[name] = (scale * rng.normal(size=(rank, n_in)).astype(np.float32),
                          scale * rng.normal(size=(n_out, rank)).astype(np.float32))
    return lora
