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
# Llama-3.1-8B's dims, vocabulary and untied head: ~8.03e9 matmul weights.
LLAMA8B = dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256,
               tied=False, rope_base=500000.0)
#: Weight types a random model can be written in: every format toygraph reads (the
#: K-quants and IQ4 ones through toygraph.gguf.block_encode).
WTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k",
          "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
# SmolLM2-135M's shapes, for machines without the real GGUF (speed does not depend on values).
SMOLLM2_SHAPES = dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
                      n_ctx=8192, rope_base=100000.0)


def write_random_llama(path, *, n_layer: int = 16, n_embd: int = 2048, n_head: int = 32,
                       n_head_kv: int = 8, n_ff: int = 8192, n_vocab: int = 32000,
                       n_ctx: int = 4096, wtype: str = "f16", tied: bool = True,
                       seed: int = 0, std: float = 0.02, rope_base: float = 10000.0) -> Path:
    """Write a random llama GGUF (every matrix in ``wtype``, one of WTYPES; norms f32)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_llama(path, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                            n_head_kv=n_head_kv, n_ff=n_ff, n_ctx=n_ctx, tied=tied, seed=seed,
                            rope_base=rope_base, n_vocab=n_vocab, std=std,
                            weight_types={role: wtype for role in MATRIX_ROLES})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--wtype", default="f16", choices=WTYPES)
    ap.add_argument("--shape", default="1b", choices=["1b", "8b"])
    ap.add_argument("--small", action="store_true", help="2 layers x 256 wide (for a quick check)")
    a = ap.parse_args(argv)
    dims = dict(LLAMA1B if a.shape == "1b" else LLAMA8B)
    if a.small:
        dims.update(n_layer=2, n_embd=256, n_head=8, n_head_kv=2, n_ff=512)
    print(write_random_llama(a.out, wtype=a.wtype, **dims))


if __name__ == "__main__":
    sys.exit(main())
