"""The tiny GGUF fixtures load in transformers, and agree with our reader on config and weights."""
import numpy as np
import pytest

from toygraph.fixtures.tiny_models import K_QUANT_TYPES, write_tiny_llama, write_tiny_qwen2
from toygraph.models.model import open_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

VARIANTS = {
    "llama.gguf": lambda p: write_tiny_llama(p),
    "llama_untied.gguf": lambda p: write_tiny_llama(p, tied=False, n_layer=1),
    "qwen2.gguf": lambda p: write_tiny_qwen2(p),
    "qwen2_kquants.gguf": lambda p: write_tiny_qwen2(p, n_embd=256, n_ff=512, weight_types=K_QUANT_TYPES),
    "llama_kquants.gguf": lambda p: write_tiny_llama(p, n_embd=256, n_ff=512, n_layer=1,
                                                     weight_types=K_QUANT_TYPES),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    for name, write in VARIANTS.items():
        write(d / name)
    return d


def hf_from_gguf_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (what transformers does when it loads llama)."""
    n_out, n_in = w.shape
    # llama.cpp wrote gguf = hf.reshape(H, 2, D/2, n_in).swapaxes(1, 2); invert it.
    return w.reshape(n_head, n_out // n_head // 2, 2, n_in).swapaxes(1, 2).reshape(n_out, n_in)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_loads_model_with_matching_config(tiny_dir, name):
    ours = open_gguf(tiny_dir / name)
    cfg = ours.config
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, gguf_file=name)
    hf = model.config
    assert hf.model_type == cfg.arch
    assert hf.num_hidden_layers == cfg.n_layer
    assert hf.hidden_size == cfg.n_embd and hf.intermediate_size == cfg.n_ff
    assert hf.num_attention_heads == cfg.n_head and hf.num_key_value_heads == cfg.n_head_kv
    assert hf.vocab_size == cfg.n_vocab
    assert hf.tie_word_embeddings == cfg.tied_output
    assert hf.max_position_embeddings == cfg.n_ctx
    assert hf.rms_norm_eps == pytest.approx(cfg.rms_eps)
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert rope["rope_theta"] == pytest.approx(cfg.attention[0].rope.base)

    # Weights: transformers dequantizes with gguf-py; ours must give the same numbers.
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(sd["model.embed_tokens.weight"],
                                  ours.tensor("token_embd.weight").dequantize())
    for i in range(cfg.n_layer):
        hf_p, gg = f"model.layers.{i}.", f"blk.{i}."
        q = ours.tensor(gg + "attn_q.weight").dequantize()
        k = ours.tensor(gg + "attn_k.weight").dequantize()
        if cfg.family.qk_permuted:  # llama: transformers un-permutes Q/K rows on load
            q, k = hf_from_gguf_qk(q, cfg.n_head), hf_from_gguf_qk(k, cfg.n_head_kv)
        np.testing.assert_array_equal(sd[hf_p + "self_attn.q_proj.weight"], q)
        np.testing.assert_array_equal(sd[hf_p + "self_attn.k_proj.weight"], k)
        for hf_name, gg_name in (("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                                 ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                                 ("mlp.down_proj", "ffn_down")):
            np.testing.assert_array_equal(sd[hf_p + hf_name + ".weight"],
                                          ours.tensor(gg + gg_name + ".weight").dequantize())
        if cfg.qkv_bias:
            np.testing.assert_array_equal(sd[hf_p + "self_attn.v_proj.bias"],
                                          ours.tensor(gg + "attn_v.bias").dequantize())
    if not cfg.tied_output:
        np.testing.assert_array_equal(sd["lm_head.weight"], ours.tensor("output.weight").dequantize())

    # Random small weights keep the logits finite and moderate.
    with torch.no_grad():
        logits = model(torch.tensor([[1, 50, 60, 70]])).logits
    assert torch.isfinite(logits).all() and logits.abs().max() < 50


@pytest.mark.parametrize("name", ["llama.gguf", "qwen2.gguf"])
def test_transformers_loads_tokenizer(tiny_dir, name):
    ours = open_gguf(tiny_dir / name)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir, gguf_file=name)
    assert len(tok) == ours.config.n_vocab
    text = "Hello the world, and that is it!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # the merges do merge
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 == tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
