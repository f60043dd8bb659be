"""FullFinetune and FromScratch: every weight trains."""
from __future__ import annotations

from .base import Recipe


class FullFinetune(Recipe):
    """Start from the GGUF weights; quantized ones become trainable f32 copies."""

    weight_mode = "finetune"

    def __repr__(self):
        return "FullFinetune()"


class FromScratch(Recipe):
    """Random init (N(0, 0.02) matrices, unit norms), embeddings included."""

    weight_mode = "scratch"

    def __repr__(self):
        return "FromScratch()"
