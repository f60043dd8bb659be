"""Write a random, Llama-shaped GGUF of any size (for benchmarks), with gguf.GGUFWriter.

A thin wrapper over ``toygraph.fixtures.tiny_models.write_tiny_llama`` with benchmark
sizes: a realistic 32k vocabulary (the fixtures' byte-level BPE padded with unused
tokens) and one weight type for every matrix. Like the fixtures, Q/K rows are written as
generated (no llama.cpp permutation): toygraph computes in the GGUF layout with the
"normal" rope and transformers un-permutes at load, so both compute the same model.

>>> write_random_llama("/tmp/llama1b/llama1b-random-f16.gguf")      # doctest: +SKIP

Run as a script to write one: ``python bench/random_llama.py OUT.gguf [--small]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


try:
    from toygraph.fixtures.tiny_models import MATRIX_ROLES, write_tiny_llama
except ImportError:  # a checkout without `pip install -e .`: fixtures/ is top-level there
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fixtures.tiny_models import MATRIX_ROLES, write_tiny_llama

# Llama-3.2-1B-like dims with a 32k vocabulary: ~1.04e9 matmul weights (incl. the tied head).
LLAMA1B = dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=32000)
# SmolLM2-135M's shapes, for machines without the real GGUF (speed does not depend on values).
SMOLLM2_SHAPES = dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
                      n_ctx=8192, rope_base=100000.0)


def write_random_llama(path, *, n_layer: int = 16, n_embd: int = 2048, n_head: int = 32,
                       n_head_kv: int = 8, n_ff: int = 8192, n_vocab: int = 32000,
                       n_ctx: int = 4096, wtype: str = "f16", tied: bool = True,
                       seed: int = 0, std: float = 0.02, rope_base: float = 10000.0) -> Path:
    """Write a random llama GGUF (every matrix in ``wtype``: f16, f32 or q8_0; norms f32)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_llama(path, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                            n_head_kv=n_head_kv, n_ff=n_ff, n_ctx=n_ctx, tied=tied, seed=seed,
                            rope_base=rope_base, n_vocab=n_vocab, std=std,
                            weight_types={role: wtype for role in MATRIX_ROLES})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--wtype", default="f16", choices=["f16", "f32", "q8_0"])
    ap.add_argument("--small", action="store_true", help="2 layers x 256 wide (for a quick check)")
    a = ap.parse_args(argv)
    dims = dict(LLAMA1B)
    if a.small:
        dims.update(n_layer=2, n_embd=256, n_head=8, n_head_kv=2, n_ff=512)
    print(write_random_llama(a.out, wtype=a.wtype, **dims))


if __name__ == "__main__":
    sys.exit(main())
