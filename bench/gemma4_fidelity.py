"""Where Gemma 4's last-position logits part from transformers' on an E2B-shaped random model
(bench/random_hf.py's layer shapes, the tiny 316-token vocabulary, 5 layers: 4 sliding + 1
global), and why: toygraph on the numpy backend in f32 and f64 against transformers in f32,
in ``model.double()`` ("stock double") and in float64 throughout (tests/test_gemma4.py's
exact_f64_reference: stock double still computes RMSNorm, rope and the embedding scales in
f32). Per layer, each side's f32 run against its own f64 run. ``--scale-q`` multiplies
each layer's q_norm weight by head_dim**-0.5 before conversion: attention scores of unit
size, as trained q_norm weights give (Gemma 4's attention scale is 1.0, and on this random
init the scores of unit-RMS q and k are ~sqrt(head_dim) = 16-23 wide).

    python bench/gemma4_fidelity.py [--scale-q | --full] [--lora] [--seeds 0,1,2]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def build(scale_q: bool):
    import torch
    import transformers
    from support.converted import tiny_sentencepiece_tokenizer
    from random_hf import GEMMA4_E2B
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    tok = tiny_sentencepiece_tokenizer(GemmaTokenizer)
    dims = dict(GEMMA4_E2B, vocab_size=len(tok), vocab_size_per_layer_input=len(tok),
                num_hidden_layers=len(GEMMA4_E2B["layer_types"]), max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**dims)).float().eval()
    if scale_q:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.5)
    return model, tok


def toygraph_hidden(path, tokens, dtype):
    """Each layer's output, the final normed hidden state and the logits, [T, ...] each."""
    import toygraph.models.decoder as decoder
    from toygraph.core.graph import Graph
    from toygraph.core.session import Session
    from toygraph.models.model import GGUFModel
    block, seen = decoder._block, []

    def recording(*args, **kw):   # _block's outputs: the residual stream after each layer
        seen.append(block(*args, **kw))
        return seen[-1]
    m = GGUFModel(path)
    B, T = tokens.shape
    g = Graph()
    decoder._block = recording
    try:
        net = decoder.build_decoder(g, m.config, batch=B, seq_len=T, model=m)
    finally:
        decoder._block = block
    outs = [g.output(h) for h in seen[:-1]] + [g.output(net.hidden), g.output(net.logits)]
    s = Session(g, dtype=dtype)
    s.realize()
    s.upload(net.tokens, tokens)
    s.upload(net.positions, np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    s.run("forward")
    return [np.asarray(s.download(o), np.float64).reshape(T, -1) for o in outs]


def hf_hidden(model, tokens):
    """The same from transformers (its last hidden state is after the final norm)."""
    import torch
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True)
    return [x[0].double().numpy() for x in out.hidden_states[1:]] + [out.logits[0].double().numpy()]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    import pytest
    from support.converted import convert, hf_model
    from test_gemma4 import exact_f64_reference
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale-q", action="store_true")
    ap.add_argument("--full", action="store_true", help="bench_lora's cached Gemma-4-E2B-shape "
                    "file instead (vocabulary 262144; ~14 GB of memory)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lora", action="store_true", help="also 4 LoRA steps vs torch + PEFT "
                    "(tests/test_peft_reference.py's train_both, every target, 24 tokens)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.full:
            from bench_lora import bench_cache
            from random_hf import random_hf_model
            path, hf_dir = random_hf_model("gemma4-e2b-shape", bench_cache())
        else:
            path, hf_dir = convert(Path(tmp), "g4", *build(args.scale_q))
        n_vocab = hf_model(hf_dir).config.vocab_size
        if args.lora:
            lora_steps(path, hf_dir, Path(tmp), n_vocab)
        f32, stock = hf_model(hf_dir), hf_model(hf_dir).double()
        runs = {}
        for seed in seeds:
            tokens = np.random.default_rng(seed).integers(0, n_vocab, (1, 24)).astype(np.int32)
            runs[seed] = (tokens, toygraph_hidden(path, tokens, "f64"),
                          toygraph_hidden(path, tokens, "f32"), hf_hidden(f32, tokens),
                          hf_hidden(stock, tokens)[-1])
        with pytest.MonkeyPatch.context() as mp:   # transformers in float64 throughout
            exact = exact_f64_reference(hf_dir, mp)
            for seed, (tokens, t64, t32, h32, h_stock) in runs.items():
                hex_ = hf_hidden(exact, tokens)
                print(f"seed {seed}: last-position logits, toygraph f64 vs transformers stock "
                      f"double {rel(t64[-1][-1], h_stock[-1]):.2e}, vs f64 throughout "
                      f"{rel(t64[-1][-1], hex_[-1][-1]):.2e}; toygraph f32 vs transformers f32 "
                      f"{rel(t32[-1][-1], h32[-1][-1]):.2e}")
                for i in range(len(t64) - 1):
                    what = f"layer {i}" if i < len(t64) - 2 else "final norm"
                    print(f"  {what:10s} f32 error: toygraph {rel(t32[i], t64[i]):.2e}  "
                          f"transformers {rel(h32[i], hex_[i]):.2e}")
                print(f"  logits     f32 error: toygraph {rel(t32[-1][-1], t64[-1][-1]):.2e}  "
                      f"transformers {rel(h32[-1][-1], hex_[-1][-1]):.2e}", flush=True)


def lora_steps(path, hf_dir, tmp: Path, n_vocab: int):
    from support.converted import hf_model
    from test_peft_reference import train_both
    from toygraph.models.decoder import TARGETS
    tokens = np.random.default_rng(0).integers(0, n_vocab, size=(1, 24)).astype(np.int32)
    mine, ref, norms = train_both(path, tmp, targets=tuple(TARGETS), rank=4, alpha=8,
                                  tokens=tokens, n_prompt=3, steps=4,
                                  reference=lambda _: hf_model(hf_dir))
    print("LoRA steps: toygraph", np.round(mine, 6).tolist(), "torch + PEFT",
          np.round(ref, 6).tolist(), "rel", [f"{abs(a - b) / abs(b):.1e}" for a, b in zip(mine, ref)],
          "grad norms", np.round(norms, 3).tolist(), flush=True)


if __name__ == "__main__":
    main()
