"""Every family against an independent reference: the loss of a tiny random GGUF against
transformers, 3 LoRA steps against torch + PEFT AdamW, the exported PEFT adapter loaded by
PEFT, and the llama.cpp adapter names.

References (transformers 5.x):
- qwen3 and gemma3: transformers loading the same GGUF. Its GGUF loader ignores
  ``attention.key_length`` for these two (it keeps the config's default head_dim, 128 or
  256, right for the released models), so head_dim is passed explicitly.
- gemma3: the attention scale. llama.cpp uses 1/sqrt(head_dim) for every Gemma 3 but the
  27B (62 layers: 1/sqrt(n_embd/n_head)); the released configs say the same through
  ``query_pre_attn_scalar`` (256 = head_dim for 270M-12B, 168 = 5376/32 for 27B).
  transformers' GGUF loader leaves query_pre_attn_scalar at its default 256, which is only
  right when head_dim is 256, so the reference sets query_pre_attn_scalar = head_dim.
- llama with ``rope_freqs.weight`` (Llama 3.x): transformers' GGUF loader ignores the
  tensor, so the reference is LlamaForCausalLM from an HF config with rope_type "llama3"
  (the config the tensor was computed from) and the GGUF's weights; likewise rope_type
  "linear" for ``rope.scaling.type = linear``.
"""
import numpy as np
import pytest

from test_llama import assert_attention_is_token_major, toygraph_loss
from test_peft_reference import _report_and_check, random_lora, rel, train_both
from toygraph.adapters.files import check_gguf_adapter, save_gguf_adapter, save_peft
from toygraph.fixtures.tiny_models import (LLAMA3_ROPE_SCALING, write_tiny_gemma3,
                                           write_tiny_llama, write_tiny_llama3, write_tiny_qwen3)
from toygraph.models.model import GGUFModel
from toygraph.inference.language_model import LanguageModel
from toygraph.models.decoder import TARGETS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.reference
ALL = tuple(TARGETS)
LINEAR = {"rope_type": "linear", "factor": 4.0}

WRITERS = {
    "qwen3": write_tiny_qwen3,
    "gemma3": write_tiny_gemma3,
    "llama3": write_tiny_llama3,
    "llama_linear": lambda p: write_tiny_llama(p, rope_scale=LINEAR["factor"], n_head=2,
                                               n_head_kv=1, std=0.3),
    "gemma3_linear": lambda p: write_tiny_gemma3(p, rope_scale=LINEAR["factor"]),
}
# What the reference must be told that transformers' GGUF loader does not read.
HF_OVERRIDES = {
    "qwen3": lambda cfg: {"head_dim": cfg.head_dim},
    "gemma3": lambda cfg: {"head_dim": cfg.head_dim, "query_pre_attn_scalar": cfg.head_dim},
    # A released Gemma 3 config's rope_scaling (linear, factor 8 for 4B-27B) lands on the
    # full-attention layers only (Gemma3TextConfig.convert_rope_params_to_dict); the GGUF
    # loader does not read it, so it is spelled out here in that form.
    "gemma3_linear": lambda cfg: {
        "head_dim": cfg.head_dim, "query_pre_attn_scalar": cfg.head_dim,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {**LINEAR, "rope_theta": global_rope_base(cfg)}}},
}
ROPE_REBUILD = {"llama3": LLAMA3_ROPE_SCALING, "llama_linear": LINEAR}


def global_rope_base(cfg):
    """The file's rope.freq_base: the full-attention layers' rope base."""
    return next(a.rope.base for a in cfg.attention if a.window == 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("arch")
    return {name: write(d / f"{name}.gguf") for name, write in WRITERS.items()}


def reference_for(name):
    """A function path -> the float32 torch model toygraph must agree with."""
    def load(path):
        cfg = GGUFModel(path).config
        kw = HF_OVERRIDES.get(name, lambda c: {})(cfg)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **kw)
        if name in ROPE_REBUILD:  # same weights, the rope the GGUF's tensor/keys describe
            hf = model.config.to_dict()
            hf["rope_parameters"] = {**ROPE_REBUILD[name], "rope_theta": global_rope_base(cfg)}
            rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(hf))
            rebuilt.load_state_dict(model.state_dict())
            model = rebuilt.float().eval()
        return model
    return load


def reference_loss(model, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1)
    return -lp.gather(-1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None]).mean().item()


def tokens_for(path, seq=16, batch=2, seed=0):
    vocab = GGUFModel(path).config.n_vocab
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)).astype(np.int32)


def test_the_fixtures_exercise_what_they_claim(models):
    q3, g3, l3 = (GGUFModel(models[n]).config for n in ("qwen3", "gemma3", "llama3"))
    for cfg in (q3, g3):
        assert cfg.head_dim * cfg.n_head != cfg.n_embd and cfg.n_embd % 32 and cfg.n_ff % 32
        assert cfg.n_head_kv < cfg.n_head
    windows = {a.window for a in g3.attention}
    assert 0 in windows and len(windows) == 2 and max(windows) < 16
    assert g3.attention[5].rope.base == 1e6 and g3.attention[0].rope.base == 10000.0
    assert l3.rope_freqs and len(set(GGUFModel(models["llama3"]).tensor(
        "rope_freqs.weight").dequantize().tolist())) >= 3  # kept, smoothed and scaled bands
    g3l = GGUFModel(models["gemma3_linear"]).config
    # the file's linear scaling on the global layers only
    assert g3l.attention[5].rope.scale == 0.25 and g3l.attention[0].rope.scale == 1.0


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_attention_is_token_major(models, name):
    """q/k norms (Qwen3, Gemma 3) and Gemma 3's sliding windows: no permute around attention."""
    assert_attention_is_token_major(models[name])


@pytest.mark.parametrize("name", list(WRITERS))
def test_loss_matches_reference(models, name):
    path = models[name]
    tokens = tokens_for(path)
    mine, ref = toygraph_loss(path, tokens), reference_loss(reference_for(name)(path), tokens)
    print(f"{name}: toygraph {mine:.7f} reference {ref:.7f} rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4


@pytest.mark.parametrize("name", ["llama3", "llama_linear"])
def test_ignoring_the_rope_change_would_be_caught(models, name):
    """transformers' plain GGUF load (no llama3/linear rope) is far from both: the rope
    factors and the scaling matter well beyond the 1e-4 tolerance on these fixtures."""
    path = models[name]
    tokens = tokens_for(path, seq=32)
    plain = reference_loss(transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32), tokens)
    assert rel(toygraph_loss(path, tokens), plain) > 1e-3


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "llama3"])
def test_lora_steps_match_peft(models, name, tmp_path):
    path = models[name]
    tokens = tokens_for(path, seq=12)
    mine, ref, norms = train_both(path, tmp_path, targets=ALL, rank=4, alpha=8, tokens=tokens,
                                  n_prompt=3, steps=3, reference=reference_for(name))
    _report_and_check(name, mine, ref, norms, 0.5)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "llama3"])
def test_exported_peft_adapter_reproduces_the_loss(models, name, tmp_path):
    path = models[name]
    cfg = GGUFModel(path).config
    save_peft(tmp_path, random_lora(cfg, ALL, 4, b_std=0.5), cfg, rank=4, alpha=8, targets=ALL)
    tokens = tokens_for(path)
    mine, _ = LanguageModel(path, adapter_dir=tmp_path).loss(tokens.tolist())
    base, _ = LanguageModel(path).loss(tokens.tolist())
    model = peft.PeftModel.from_pretrained(reference_for(name)(path), str(tmp_path))
    ref = reference_loss(model, tokens)
    print(f"{name}: base {base:.7f} adapter: toygraph {mine:.7f} peft {ref:.7f}")
    assert rel(mine, ref) <= 1e-4
    assert abs(mine - base) > 100 * 1e-4 * ref


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "llama3"])
def test_gguf_adapter_uses_llama_cpp_names(models, name, tmp_path):
    path = models[name]
    cfg = GGUFModel(path).config
    lora = random_lora(cfg, ALL, 2)
    out = save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=4, base_arch=cfg.arch)
    info = check_gguf_adapter(out, path)  # llama.cpp's rules against the base file
    want = {f"blk.{i}.{proj}.weight" for i in range(cfg.n_layer)
            for proj in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                         "ffn_down")}
    assert set(info["tensors"]) == want and info["rank"] == 2


@pytest.mark.parametrize("change", [
    {"sliding_window": 1000},   # every layer full attention
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
])
def test_gemma3_window_and_local_rope_base_matter(models, change):
    """The reference with no sliding window, or with the file's base on the sliding layers
    too, is far from toygraph: the fixture exercises both (seq 16 > window 5)."""
    path = models["gemma3"]
    cfg = GGUFModel(path).config
    tokens = tokens_for(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        **{**HF_OVERRIDES["gemma3"](cfg), **change})
    assert rel(toygraph_loss(path, tokens), reference_loss(model, tokens)) > 1e-3


def test_gemma3_norm_weights_are_used_as_stored(models):
    """llama.cpp's converter stores Gemma's RMSNorm weight as 1 + w; transformers' GGUF
    loader subtracts the 1 again and its Gemma3RMSNorm multiplies by (1 + w). So the
    stored value is the multiplier, which is how toygraph uses it."""
    path = models["gemma3"]
    gg = GGUFModel(path)
    hf = reference_for("gemma3")(path).model
    layer = hf.layers[0]
    for gguf_name, module in (("blk.0.attn_norm.weight", layer.input_layernorm),
                              ("blk.0.attn_q_norm.weight", layer.self_attn.q_norm),
                              ("blk.0.post_ffw_norm.weight", layer.post_feedforward_layernorm),
                              ("output_norm.weight", hf.norm)):
        stored = gg.tensor(gguf_name).dequantize()
        np.testing.assert_allclose(1.0 + module.weight.detach().numpy(), stored, rtol=1e-6)
        assert abs(stored.mean() - 1.0) < 0.1  # the fixture's weights are near 1, not near 0
