"""Write a random, Qwen3-30B-A3B-shaped GGUF (qwen3moe) of any depth, for benchmarks.

Shapes are Qwen3-30B-A3B's (hidden 2048, 32 q / 4 kv heads of 128, 128 experts, top-8,
expert FFN 768, vocabulary 151936); block types follow llama.cpp's Q4_K_M recipe
(llama_tensor_get_type): q4_k everywhere but the output head, attn_v and ffn_down_exps in
the "more bits" layers (the first and last eighth, and every third in between) in q6_k;
norms and the router (ffn_gate_inp, never quantized by llama.cpp) in f32.

Encoding 30e9 random weights would take hours, so each matrix's rows are drawn from a
pool of 64 rows encoded once per (type, width) with toygraph.gguf.block_encode: the
blocks are valid, the experts differ (each takes the pool rows in its own order), and a
step's speed does not depend on the values. The tokenizer is the fixtures' byte-level BPE
padded with unused tokens to 151936. Tensors are streamed to the file one at a time
(gguf.GGUFWriter.add_tensor_info / write_tensor_data), so memory stays at one tensor.

>>> write_random_qwen3moe("/tmp/moe/qwen3moe-6l.gguf", n_layer=6)     # doctest: +SKIP
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

try:
    from toygraph.fixtures.tiny_models import tiny_vocab
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fixtures.tiny_models import tiny_vocab
from toygraph.gguf import block_encode, blocks

QWEN3_30B_A3B = dict(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                     n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936)
_POOL = 64


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layer): Q4_K_M's q6_k layers."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _pool(qtype: str, width: int, rng) -> np.ndarray:
    rows = (rng.standard_normal((_POOL, width)) * 0.02).astype(np.float32)
    return block_encode.quantize(rows, qtype).reshape(_POOL, -1)


def _rows(pool: np.ndarray, n_rows: int, seed: int) -> np.ndarray:
    """n_rows encoded rows drawn from the pool, in an order that depends on seed."""
    idx = (np.arange(n_rows, dtype=np.int64) * 7 + seed * 13 + (np.arange(n_rows) // _POOL)) % _POOL
    return pool[idx]


def write_random_qwen3moe(path, *, n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
                          head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768,
                          n_vocab=151936, seed=0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pools: dict[tuple[str, int], np.ndarray] = {}
    tensors = []  # (name, numpy shape, storage, make())

    def mat(name, shape, qtype, salt):
        key = (qtype, shape[-1])
        if key not in pools:
            pools[key] = _pool(qtype, shape[-1], rng)
        pool = pools[key]
        rows = int(np.prod(shape[:-1]))
        tensors.append((name, shape, qtype,
                        lambda: _rows(pool, rows, salt).reshape(*shape[:-1], -1)))

    def f32(name, shape, std=None):
        r = np.random.default_rng(len(tensors))
        tensors.append((name, shape, "f32", lambda: (np.ones(shape, np.float32) if std is None
                        else (r.standard_normal(shape) * std).astype(np.float32))))

    mat("token_embd.weight", (n_vocab, n_embd), "q4_k", 1)
    for i in range(n_layer):
        b = f"blk.{i}."
        six = "q6_k" if more_bits(i, n_layer) else "q4_k"
        f32(b + "attn_norm.weight", (n_embd,))
        mat(b + "attn_q.weight", (n_head * head_dim, n_embd), "q4_k", 10 * i + 2)
        mat(b + "attn_k.weight", (n_head_kv * head_dim, n_embd), "q4_k", 10 * i + 3)
        mat(b + "attn_v.weight", (n_head_kv * head_dim, n_embd), six, 10 * i + 4)
        mat(b + "attn_output.weight", (n_embd, n_head * head_dim), "q4_k", 10 * i + 5)
        f32(b + "attn_q_norm.weight", (head_dim,))
        f32(b + "attn_k_norm.weight", (head_dim,))
        f32(b + "ffn_norm.weight", (n_embd,))
        f32(b + "ffn_gate_inp.weight", (n_expert, n_embd), std=0.02)
        mat(b + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), "q4_k", 10 * i + 6)
        mat(b + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), "q4_k", 10 * i + 7)
        mat(b + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), six, 10 * i + 8)
    f32("output_norm.weight", (n_embd,))
    mat("output.weight", (n_vocab, n_embd), "q6_k", 9)

    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("random Qwen3-30B-A3B-shaped")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(6144)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens, token_types, merges = tiny_vocab()
    pad = n_vocab - len(tokens)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(pad)])
    w.add_token_types(token_types + [int(gguf.TokenType.UNUSED)] * pad)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    for name, shape, storage, _ in tensors:
        if storage == "f32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            nbytes = blocks.nbytes(storage, shape)
            byte_shape = (*shape[:-1], nbytes // int(np.prod(shape[:-1])))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType[storage.upper()])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in tensors:
        w.write_tensor_data(make())
    w.close()
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print(write_random_qwen3moe(out, **dict(QWEN3_30B_A3B, n_layer=int(sys.argv[2]))))
