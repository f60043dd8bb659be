"""Qwen3.5 against transformers: a tiny random Qwen3_5ForCausalLM built by transformers (three
Gated DeltaNet layers, then gated full attention, twice), written to GGUF by llama.cpp's
convert_hf_to_gguf.py (tests/support/converted.py), with fewer key heads than value heads (the
file's tiled value-head order), partial rotary dims and q/k norms, on sequences longer than
the delta rule's chunk (64). The loss is compared with transformers' model on the same
weights, LoRA steps on every projection (the DeltaNet's too) with torch + PEFT, the exported
PEFT adapter reloaded in PEFT, and generation with the recurrent state against the full
window."""
import numpy as np
import pytest

from support.converted import check_adapter_loss, check_checkpointing, convert, hf_model
from test_arch_models import reference_loss
from test_llama import assert_attention_is_token_major, toygraph_loss
from test_peft_reference import _report_and_check, random_lora, rel, train_both
from toygraph.adapters.files import check_gguf_adapter, load_peft, save_gguf_adapter, save_peft
from toygraph.inference.language_model import LanguageModel
from toygraph.models.decoder import DELTANET_TARGETS, TARGETS
from toygraph.models.model import GGUFModel
from toygraph.models.parts import DeltaNet

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.reference
ALL = (*TARGETS, *DELTANET_TARGETS)   # every projection of a Qwen3.5 layer


def build(k_heads=2, v_heads=4):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"eos_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=48, intermediate_size=80, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]})
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():  # far from the init, so every part shows in the loss
        for name, w in model.named_parameters():
            if name.endswith("A_log"):
                w.copy_(torch.log(torch.rand_like(w) * 2 + 0.2))
            elif "linear_attn.norm" in name:
                w.normal_(1.0, 0.2)
            else:
                w.normal_(0.0, 0.2 if "norm" in name or "dt_bias" in name else 0.3)
    return model.float().eval(), tok


@pytest.fixture(scope="module", params=[(2, 4), (2, 2)], ids=["tiled", "equal"])
def qwen35(request, tmp_path_factory):
    model, tok = build(*request.param)
    return convert(tmp_path_factory.mktemp("qwen35"), "qwen35", model, tok, pre="qwen35",
                   args=("--no-mtp",))


def tokens_for(n_vocab, seq=16, batch=2, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, size=(batch, seq)).astype(np.int32)


def test_attention_layers_are_token_major(qwen35):
    """The gated full-attention layers take q, k, v token-major (no permute)."""
    assert_attention_is_token_major(qwen35[0])


def test_the_file_is_read_as_written(qwen35):
    path, _ = qwen35
    cfg = GGUFModel(path).config
    recurrent = [isinstance(layer.mixer, DeltaNet) for layer in cfg.layers]
    assert recurrent == [True, True, True, False] * 2 and {a.rope.dims for a in cfg.attention} == {4}
    assert (cfg.ssm.conv, cfg.ssm.k_heads, cfg.ssm.k_dim, cfg.ssm.v_dim) == (4, 2, 8, 12)



def test_every_norm_weight_is_read_inside_its_norm(qwen35):
    """The gated deltanet output norm: the weight in the norm's kernels (ops/norm/)."""
    from test_ops_norm import check_norm_weights_in_their_norms
    check_norm_weights_in_their_norms(qwen35[0])

@pytest.mark.parametrize("seq", [16, 150])
def test_loss_matches_transformers(qwen35, seq):
    path, hf_dir = qwen35
    tokens = tokens_for(GGUFModel(path).config.n_vocab, seq=seq, batch=2 if seq < 100 else 1)
    mine, ref = toygraph_loss(path, tokens), reference_loss(hf_model(hf_dir), tokens)
    print(f"qwen35 seq {seq}: toygraph {mine:.7f} transformers {ref:.7f} rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4


def test_lora_steps_on_every_projection_match_peft(qwen35, tmp_path):
    path, hf_dir = qwen35
    tokens = tokens_for(GGUFModel(path).config.n_vocab, seq=12)
    mine, ref, norms = train_both(path, tmp_path, targets=ALL, rank=4, alpha=8, tokens=tokens,
                                  n_prompt=3, steps=3, reference=lambda _: hf_model(hf_dir))
    _report_and_check("qwen35", mine, ref, norms, 0.5)


def test_exported_adapters_reproduce_the_loss(qwen35, tmp_path):
    """PEFT (value heads back in Hugging Face's grouped order) and llama.cpp's GGUF adapter
    (file order), each with every DeltaNet projection."""
    path, hf_dir = qwen35
    m = GGUFModel(path)
    lora = random_lora(m.config, ALL, 4, b_std=0.5, present=m.tensor_names())
    assert {n.split(".")[2] for n in lora} >= {"attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"}
    save_peft(tmp_path, lora, m.config, rank=4, alpha=8, targets=ALL)
    back, *_ = load_peft(tmp_path, m.config)
    assert all(np.array_equal(back[n][0], a) and np.array_equal(back[n][1], b) for n, (a, b) in lora.items())
    tokens = tokens_for(m.config.n_vocab)
    check_adapter_loss(path, hf_dir, tmp_path, tokens, "qwen35")
    out = save_gguf_adapter(tmp_path / "a.gguf", lora, m.config, alpha=8, base_arch="qwen35")
    info = check_gguf_adapter(out, path)   # llama.cpp's rules against the base file
    assert set(info["tensors"]) == set(lora) and "blk.0.ssm_out.weight" in info["tensors"]


def test_tokenizer_matches_transformers(qwen35):
    from test_tokenizer_real_files import CORPUS
    from toygraph.gguf.tokenizer import Tokenizer
    path, hf_dir = qwen35
    tok = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in CORPUS + ["naïve e\u0301 \u0915\u093f"]:   # combining marks stay with letters
        assert tok.encode(text) == ref.encode(text), text


def test_cached_generation_carries_the_recurrent_state(qwen35):
    """Prefill (prompt padded to its bucket: the padding must not move the state) then
    decode with the conv rows and the delta rule's state, against the full window."""
    from test_kvcache import check_paths_agree
    path, _ = qwen35
    lm = LanguageModel(path)
    for prompt, n in (("the cat at the hat", 12), ("a", 6)):
        tokens = check_paths_agree(lm, lm.tokenizer.encode(prompt), n)
        assert len(set(tokens)) > 1


def test_grpo_samples_in_its_training_graph(qwen35, tmp_path):
    """GRPO's sampler inside the training graph, after a few updates, against a standalone
    generator loaded with the adapter's values."""
    from test_grpo import check_the_sampler_shares_the_trained_tensors, write_prompts
    path, _ = qwen35
    check_the_sampler_shares_the_trained_tensors(path, write_prompts(tmp_path),
                                                 rewards=("regex:[aeiou]",))


def test_batched_generation_carries_each_rows_recurrent_state(qwen35):
    """GRPO's sampler: per row its own padded prefill state and conv window, against the
    one-row cache, for prompts of different lengths. The same tokens; the logits to 3e-5
    (not 1e-5): the prefill's padded length differs from the one-row bucket's, so the delta
    rule's chunks sum in another order, and this random model amplifies f32 rounding (see
    the CUDA test below)."""
    from test_batched import assert_rows_are_one_row_generation
    path, _ = qwen35
    assert_rows_are_one_row_generation(LanguageModel(path), tol=3e-5)


def test_a_shared_prefill_spreads_the_recurrent_state(qwen35):
    """One prefill per distinct prompt: the conv rows and delta-rule states spread to the
    rows that share a prompt (tolerance as above)."""
    from test_batched import assert_shared_prefill_is_each_rows_own
    path, _ = qwen35
    assert_shared_prefill_is_each_rows_own(LanguageModel(path), tol=3e-5)


def test_gradients_and_generation_on_the_cuda_kernels(qwen35, monkeypatch):
    """Every op of a Qwen3.5 LoRA backward (all projections, 70 tokens: past the delta rule's
    64-step chunk) and of cached generation through the CUDA backend, its kernels run by
    the host executor, against numpy. This random model amplifies f32 rounding (numpy's f32
    gradients are ~2e-3 from its f64 ones), so both f32 backends are held to f64."""
    from support.hostparity import rel_err, run_phase
    from test_kvcache import greedy_steps, normwise
    from toygraph import ops
    from toygraph.core.autodiff import accumulate_grads, backward
    from toygraph.core.graph import Graph
    from toygraph.models.decoder import (BuildOptions, LoraConfig, WeightSource, build_decoder,
                                         lm_head)
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    path, _ = qwen35
    m, T = GGUFModel(path), 70
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m), batch=1, seq_len=T,
                        lora=LoraConfig(targets=ALL, rank=4, alpha=8, init_scale=0.3),
                        options=BuildOptions(logits=False))
    for _, b in net.lora.values():   # B = 0 would leave A without a gradient
        b.data = np.random.default_rng(1).normal(size=b.shape).astype(np.float32) * 0.1
    labels = g.input("labels", (T,), "i32")
    loss = g.output(ops.cross_entropy(lm_head(net), labels, reduction="sum"))
    grads = accumulate_grads(backward(loss, net.params))
    tokens = tokens_for(m.config.n_vocab, seq=T, batch=1)
    inputs = {net.tokens: tokens, net.positions: np.arange(T, dtype=np.int32)[None],
              labels: np.append(tokens[0, 1:], 0).astype(np.int32)}
    fetch = [loss] + [grads[p] for p in net.params]
    cpu, cuda = (run_phase(g, backend, inputs, "backward", fetch) for backend in ("cpu", "cuda"))
    exact = run_phase(g, "cpu", inputs, "backward", fetch, dtype="f64")
    err = {name: max(rel_err(a, b) for a, b in zip(got, exact))
           for name, got in (("numpy", cpu), ("cuda", cuda))}
    print("qwen35 gradients vs f64:", err)
    assert rel_err(cuda[0], cpu[0]) <= 1e-5 and err["cuda"] <= 5e-3 and err["numpy"] <= 5e-3
    lm_cpu, lm_cuda = LanguageModel(path), LanguageModel(path, backend="cuda")
    ids = lm_cpu.tokenizer.encode("the cat at the hat")
    got, got_logits = greedy_steps(lm_cuda, ids, 6, kv_cache=True)
    want, want_logits = greedy_steps(lm_cpu, ids, 6, kv_cache=False)
    assert got == want and normwise(got_logits, want_logits) <= 1e-4


def test_activation_checkpointing_gives_the_same_steps(qwen35):
    check_checkpointing(qwen35[0], ALL)


def test_sample_packing_is_refused(qwen35):
    from toygraph.core.graph import Graph
    from toygraph.errors import GraphError
    from toygraph.models.decoder import BuildOptions, WeightSource, build_decoder
    m = GGUFModel(qwen35[0])
    with pytest.raises(GraphError, match="packing is not supported for qwen35"):
        build_decoder(Graph(), m.config, WeightSource(m), batch=1, seq_len=8,
                      options=BuildOptions(packed=True))
