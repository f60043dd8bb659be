"""The dense gated feed-forward part, down(act(gate(x)) * up(x)), as graph ops."""
from __future__ import annotations

from toygraph import ops
from toygraph.models.parts import Dense

# Gated FFN activations by name (parts.Dense/Experts.activation): act(gate) * up;
# gpt-oss's alpha and limit are the constants llama.cpp's build_moe_ffn uses for
# LLM_FFN_SWIGLU_OAI_MOE (and transformers' GptOssConfig defaults; the GGUF has no key).
ACTIVATIONS = {"swiglu": ops.swiglu, "geglu": ops.geglu,
               "swiglu_oai": lambda gate, up: ops.swiglu_oai(gate, up, alpha=1.702, limit=7.0)}
# The plain activation of each gated one, where a part gates without an up projection
# (Gemma 4's per-layer input gate).
GATES = {"swiglu": ops.silu, "geglu": ops.gelu}


def dense_ffn(b, part: Dense, x):
    """down(act(gate(x)) * up(x)) on x [N, n_embd] (b: the layer's models/decoder.Block)."""
    s = part.suffix
    return b.proj(ACTIVATIONS[part.activation](b.proj(x, "ffn_gate" + s), b.proj(x, "ffn_up" + s)),
                  "ffn_down" + s)
