"""Gemma 4 text against transformers: a tiny random Gemma4ForCausalLM built by transformers,
written to GGUF by llama.cpp's convert_hf_to_gguf.py (tests/support/converted.py), with every part
the architecture carries switched on: sliding and global layers with their own head sizes,
KV-head counts and rope (the global layers' "proportional" partial rope through
rope_freqs), keys reused as values on the global layers (attention_k_eq_v), KV sharing
across the last layers, double-wide MLPs on those layers, per-layer input embeddings, q/k/v
norms, layer scalars and final-logit soft capping. The loss is compared with transformers'
model on the same weights (its own safetensors folder), LoRA steps with torch + PEFT, and
the exported adapter is reloaded in PEFT."""
import numpy as np
import pytest

from support.converted import check_adapter_loss, check_checkpointing, convert, hf_model, tiny_sentencepiece_tokenizer
from test_arch_models import reference_loss
from test_llama import assert_attention_is_token_major, toygraph_loss
from test_peft_reference import _report_and_check, random_lora, rel, train_both
from toygraph.adapters.files import save_peft
from toygraph.inference.language_model import LanguageModel
from toygraph.models.decoder import TARGETS
from toygraph.models.model import GGUFModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.reference
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention"]


def build(**overrides):
    """The tiny model: 6 layers (2 global), the last 2 reusing layers 3 and 2's K/V."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    tok = tiny_sentencepiece_tokenizer(GemmaTokenizer)
    kw = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=80, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
              layer_types=LAYER_TYPES, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=len(tok), final_logit_softcapping=3.0,
              max_position_embeddings=256, use_double_wide_mlp=True,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional",
                                                  "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}})
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**kw, **overrides}))
    with torch.no_grad():  # weights far from their init, so every part shows in the loss
        for name, w in model.named_parameters():
            w.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.3)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.15 * i)
    return model.float().eval(), tok


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    model, tok = build()
    return convert(tmp_path_factory.mktemp("gemma4"), "gemma4", model, tok)


def tokens_for(n_vocab, seq=16, batch=2):
    return np.random.default_rng(0).integers(0, n_vocab, size=(batch, seq)).astype(np.int32)


def test_attention_is_token_major(gemma4):
    """Shared keys and values too: no permute around any layer's attention."""
    assert_attention_is_token_major(gemma4[0])


def test_the_file_carries_every_part(gemma4):
    path, _ = gemma4
    m = GGUFModel(path)
    cfg = m.config
    attn = cfg.attention
    assert [a.head_dim for a in attn] == [16, 16, 32, 16, 16, 32]
    assert [a.kv_heads for a in attn] == [2, 2, 1, 2, 2, 1]
    assert [layer.ffn.width for layer in cfg.layers] == [80, 80, 80, 80, 160, 160]
    assert [a.window for a in attn] == [5, 5, 0, 5, 5, 0]
    assert [a.kv_from for a in attn] == [None] * 4 + [3, 2]
    assert [a.keys_as_values for a in attn] == [False, False, True, False, False, False]
    assert cfg.ple_dim == 8 and cfg.logit_softcap == 3.0
    assert (attn[2].rope.dims, attn[2].rope.factors) == (32, "rope_freqs.weight")
    assert (attn[0].rope.dims, attn[0].rope.factors) == (16, None)
    assert {a.scale for a in attn} == {1.0}
    assert [a.rope.base for a in attn[:3]] == [10000.0, 10000.0, 1e6]
    names = set(m.tensor_names())
    assert "blk.2.attn_v.weight" not in names and "blk.0.attn_v.weight" in names
    assert "blk.4.attn_k.weight" not in names and "blk.4.attn_q.weight" in names
    factors = m.tensor("rope_freqs.weight").dequantize()
    assert factors.tolist() == [1.0] * 4 + [np.float32(1e30)] * 12  # 0.25 of the 32 dims turn



def test_every_norm_weight_is_read_inside_its_norm(gemma4):
    """Per-layer projection norm, post norms, q/k norms: the weight in the norm's kernels (ops/norm/)."""
    from test_ops_norm import check_norm_weights_in_their_norms
    check_norm_weights_in_their_norms(gemma4[0])

@pytest.mark.parametrize("seq", [16, 40])
def test_loss_matches_transformers(gemma4, seq):
    path, hf_dir = gemma4
    tokens = tokens_for(GGUFModel(path).config.n_vocab, seq=seq)
    mine, ref = toygraph_loss(path, tokens), reference_loss(hf_model(hf_dir), tokens)
    print(f"gemma4 seq {seq}: toygraph {mine:.7f} transformers {ref:.7f} rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4


@pytest.mark.parametrize("change", [
    {"final_logit_softcapping": None}, {"sliding_window": 1000},
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}])
def test_each_part_matters(gemma4, change):
    """The reference without soft capping, without the sliding window, or with full rather
    than proportional rope on the global layers is far from toygraph on this fixture."""
    path, hf_dir = gemma4
    tokens = tokens_for(GGUFModel(path).config.n_vocab)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              **change)
    assert rel(toygraph_loss(path, tokens), reference_loss(model, tokens)) > 1e-3


def test_lora_steps_match_peft(gemma4, tmp_path):
    path, hf_dir = gemma4
    tokens = tokens_for(GGUFModel(path).config.n_vocab, seq=12)
    mine, ref, norms = train_both(path, tmp_path, targets=tuple(TARGETS), rank=4, alpha=8,
                                  tokens=tokens, n_prompt=3, steps=3,
                                  reference=lambda _: hf_model(hf_dir))
    _report_and_check("gemma4", mine, ref, norms, 0.5)


def test_exported_peft_adapter_reproduces_the_loss(gemma4, tmp_path):
    path, hf_dir = gemma4
    m = GGUFModel(path)
    lora = random_lora(m.config, tuple(TARGETS), 4, b_std=4.0, present=m.tensor_names())
    save_peft(tmp_path, lora, m.config, rank=4, alpha=8, targets=tuple(TARGETS))
    tokens = tokens_for(m.config.n_vocab)
    check_adapter_loss(path, hf_dir, tmp_path, tokens, "gemma4")


def test_tokenizer_matches_transformers(gemma4):
    from test_tokenizer_real_files import CORPUS
    from toygraph.gguf.tokenizer import Tokenizer
    # The reference is the model's own tokenizer (transformers' GGUF loader cannot build a
    # config from this file: it reads the per-layer feed_forward_length array as one int).
    path, hf_dir = gemma4
    tok = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.encode("ab") == tok.encode("ab", add_bos=False)   # no BOS by default
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids), text


def test_cached_generation_matches_the_full_window(gemma4):
    """The KV cache with per-layer head sizes and KV-head counts, and the shared layers
    attending with their source layers' keys and values (prompt past the window of 5)."""
    from test_kvcache import check_paths_agree
    path, _ = gemma4
    lm = LanguageModel(path)
    tokens = check_paths_agree(lm, lm.tokenizer.encode("the cat sat on the mat and the dog"), 12)
    assert len(set(tokens)) > 1


def test_grpo_samples_in_its_training_graph(gemma4, tmp_path):
    """GRPO's sampler inside the training graph, after a few updates, against a standalone
    generator loaded with the adapter's values."""
    from test_grpo import check_the_sampler_shares_the_trained_tensors, write_prompts
    path, _ = gemma4
    check_the_sampler_shares_the_trained_tensors(path, write_prompts(tmp_path),
                                                 rewards=("regex:[aeiou]",))


def test_batched_generation_rows_are_one_row_generation(gemma4):
    """GRPO's sampler with per-layer head shapes and the shared layers' K/V, past the
    window of 5. The same tokens; the logits to 3e-5 (not 1e-5): on this random model f32
    rounding alone moves them ~1e-5 (the one-row cache against the full window: 9.9e-6 on
    the 5-token prompt), and the batch changes the GEMMs' shapes, so their rounding."""
    from test_batched import assert_rows_are_one_row_generation
    path, _ = gemma4
    assert_rows_are_one_row_generation(LanguageModel(path), tol=3e-5)


def test_a_shared_prefill_gives_each_row_its_own_tokens(gemma4):
    """One prefill per distinct prompt, spread to the rows: the shared layers' caches too
    (tolerance as above)."""
    from test_batched import assert_shared_prefill_is_each_rows_own
    path, _ = gemma4
    assert_shared_prefill_is_each_rows_own(LanguageModel(path), tol=3e-5)


def test_activation_checkpointing_gives_the_same_steps(gemma4):
    """Recomputing each block in the backward: the shared layers read keys and values made
    in an earlier block, and every block reads the per-layer inputs made before the first."""
    path, _ = gemma4
    check_checkpointing(path, tuple(TARGETS))


def test_the_fused_head_refuses_a_soft_capped_model(gemma4):
    """ops.linear_cross_entropy (the CUDA recipes' head) has no soft cap: fused_head_loss
    must refuse Gemma 4's head rather than compute another model's loss; lm_head caps."""
    from toygraph import ops
    from toygraph.core.graph import Graph
    from toygraph.errors import GraphError
    from toygraph.models.decoder import (BuildOptions, WeightSource, build_decoder,
                                         fused_head_loss, lm_head)
    path, _ = gemma4
    m = GGUFModel(path)
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m), batch=1, seq_len=4,
                        options=BuildOptions(logits=False))
    labels = g.input("labels", (4,), "i32")
    with pytest.raises(GraphError, match="soft-capped at 3.0"):
        fused_head_loss(net, net.hidden, labels, "mean")
    assert "logit_softcap" not in net.head.attrs   # the fact is the model's, not the tensor's
    assert lm_head(net).op == "softcap"


@pytest.mark.parametrize("recipe", ["lora", "dpo"])
def test_the_recipes_take_the_soft_capped_head_on_cuda_too(gemma4, recipe):
    """recipes.base.fused_head says no for a soft-capped model, so a CUDA graph of an SFT
    or a preference recipe (built, not run) uses lm_head (softcap) + the unfused loss."""
    from toygraph.recipes import RecipeOptions, recipe_class
    path, _ = gemma4
    m = GGUFModel(path)
    r = recipe_class(recipe)(targets=("q", "v"))
    g = r.build_graph(m, m.config, RecipeOptions(seq_len=8, batch=1, backend="cuda"))
    ops_used = {t.op for t in g.nodes}
    assert "softcap" in ops_used and "linear_cross_entropy" not in ops_used


def exact_f64_reference(hf_dir, monkeypatch):
    """transformers' model in float64 throughout. ``model.double()`` alone is not: Gemma 4's
    RMSNorm upcasts with ``.float()`` (float32, whatever the model's dtype), the rotary
    embedding computes inv_freq, the angles and cos/sin in float32, and sqrt(hidden_size)
    and sqrt(hidden_size_per_layer_input) are buffers made in float32. On a
    Gemma-4-E2B-shaped random model those alone put the double model's logits 3e-6 (tiny
    vocabulary) to 2.7e-5 (262144) from an f64 computation (bench/results/cpu-qwen35-gemma4-shapes-2026-11-25.md, "Fidelity")."""
    import transformers.models.gemma4.modeling_gemma4 as gemma4_hf

    def rms_norm(self, x):   # transformers 5.25 renamed the norm's eps to variance_epsilon
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return y * self.weight if self.with_scale else y

    def rotary(self, x, position_ids, layer_type):
        angles = position_ids[..., None].double() * getattr(self, f"{layer_type}_inv_freq")
        emb = torch.cat((angles, angles), -1)
        scaling = getattr(self, f"{layer_type}_attention_scaling")
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    monkeypatch.setattr(gemma4_hf.Gemma4RMSNorm, "forward", rms_norm)
    monkeypatch.setattr(gemma4_hf.Gemma4TextRotaryEmbedding, "forward", rotary)
    model = hf_model(hf_dir).double()
    cfg, rot = model.config, model.model.rotary_emb
    for kind in rot.layer_types:  # transformers' formulas (default and proportional), in f64
        rp, dim = cfg.rope_parameters[kind], cfg.per_layer_config[kind].head_dim
        turning = int(rp.get("partial_rotary_factor", 1.0) * dim // 2)
        inv = rp["rope_theta"] ** -(torch.arange(0, 2 * turning, 2, dtype=torch.float64) / dim)
        inv = torch.cat([inv, torch.zeros(dim // 2 - turning, dtype=torch.float64)])
        setattr(rot, f"{kind}_inv_freq", inv / rp.get("factor", 1.0))
    model.model.embed_tokens.embed_scale.fill_(cfg.hidden_size ** 0.5)
    model.model.embed_tokens_per_layer.embed_scale.fill_(cfg.hidden_size_per_layer_input ** 0.5)
    return model


def toygraph_logits(path, tokens, dtype):
    """The logits [batch, seq, vocab] of our graph on the numpy backend at ``dtype``."""
    from toygraph.core.graph import Graph
    from toygraph.core.session import Session
    from toygraph.models.decoder import WeightSource, build_decoder
    m = GGUFModel(path)
    B, T = tokens.shape
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m), batch=B, seq_len=T)
    out = g.output(net.logits)
    s = Session(g, dtype=dtype)
    s.realize()
    s.upload(net.tokens, tokens)
    s.upload(net.positions, np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    s.run("forward")
    return np.asarray(s.download(out), dtype=np.float64).reshape(B, T, -1)


def test_f64_logits_equal_transformers_in_f64(gemma4, monkeypatch):
    """In float64 on both sides the logits are the same to rounding (1e-10), not merely
    close: every part of the layer is transformers' formula, which the f32 tolerances of
    the other tests (1e-4) could not tell. The window of 5 and the shared layers are
    crossed (24 tokens)."""
    path, hf_dir = gemma4
    tokens = tokens_for(GGUFModel(path).config.n_vocab, seq=24)
    mine = toygraph_logits(path, tokens, "f64")
    model = exact_f64_reference(hf_dir, monkeypatch)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits
    diff = np.linalg.norm(mine - ref.numpy()) / np.linalg.norm(ref.numpy())
    print(f"gemma4 f64 logits: toygraph vs transformers (f64 throughout) rel {diff:.2e}")
    assert diff <= 1e-10


def test_f64_gradients_equal_transformers_in_f64(gemma4, monkeypatch):
    """The backward too: the loss's gradient for every weight the file carries (full
    fine-tuning, f64) is transformers' autograd gradient (f64 throughout, the layer scalars
    included) to 1e-9 of its largest entry. Weights are paired by value (every random
    tensor is distinct), so no name table can hide a swapped pair."""
    from toygraph import ops
    from toygraph.core.autodiff import accumulate_grads, backward
    from toygraph.core.graph import Graph
    from toygraph.core.session import Session
    from toygraph.models.decoder import WeightSource, build_decoder
    path, hf_dir = gemma4
    m = GGUFModel(path)
    tokens = tokens_for(m.config.n_vocab, seq=12)
    B, T = tokens.shape
    labels = np.concatenate([tokens[:, 1:], np.full((B, 1), -1)], 1).astype(np.int32)
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m, "finetune"), batch=B, seq_len=T)
    lab = g.input("labels", (B * T,), "i32")
    loss = g.output(ops.cross_entropy(net.logits, lab))
    accumulate_grads(backward(loss, net.params))
    s = Session(g, dtype="f64")
    s.realize()
    s.reset()
    s.upload(net.tokens, tokens)
    s.upload(net.positions, np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    s.upload(lab, labels.ravel())
    s.run("backward")
    model = exact_f64_reference(hf_dir, monkeypatch)
    scalars = {f"layer_scalar.{i}": layer.layer_scalar.requires_grad_()  # a buffer there
               for i, layer in enumerate(model.model.layers)}
    logits = model(torch.tensor(tokens, dtype=torch.long)).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1),
                                            torch.tensor(labels.ravel()).long(), ignore_index=-1)
    ref.backward()
    assert abs(float(s.download(loss)) - ref.item()) <= 1e-12 * ref.item()
    theirs = {**dict(model.named_parameters()), **scalars}
    worst = 0.0
    for p in net.params:
        value = m.tensor(p.name).dequantize().astype(np.float64).ravel()
        match = [n for n, q in theirs.items() if q.numel() == value.size
                 and np.array_equal(q.detach().numpy().ravel(), value)]
        assert len(match) == 1, (p.name, match)
        want = theirs.pop(match[0]).grad.numpy().ravel()
        got = np.asarray(s.download(g.find(f"grad.{p.name}"))).ravel()
        # The floor: the last layer's scalar has a gradient of ~1e-8 (the final RMSNorm
        # undoes any scale of its input; only eps sees it), compared absolutely.
        worst = max(worst, np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))
    print(f"gemma4 f64 gradients of {len(net.params)} weights: worst rel {worst:.2e}")
    assert worst <= 1e-9 and not theirs   # every trainable weight of theirs was compared


def test_head_facts_are_read_per_layer(gemma4):
    """The sliding layers have 16-wide heads, the global ones 32: no one head size stands for
    the model, so asking for one is an error, and the checks that need one (the rank against
    the matrices' widths) read every layer's."""
    from toygraph.errors import GGUFError, ToygraphError
    from toygraph.training.run_config import RunConfig, check_against_model
    path, _ = gemma4
    cfg = GGUFModel(path).config
    assert {a.head_dim for a in cfg.attention} == {16, 32}
    with pytest.raises(GGUFError, match="head_dim varies by layer"):
        cfg.head_dim
    run = dict(model="m.gguf", data="d.jsonl", out="o", targets=["q"], seq_len=16)
    check_against_model(RunConfig(**run, rank=48), cfg)   # q: d = 48 -> 64 or 128
    with pytest.raises(ToygraphError, match="exceeds the q matrix's smaller side 48"):
        check_against_model(RunConfig(**run, rank=49), cfg)
