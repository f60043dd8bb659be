"""Mixture-of-experts families against independent references: tiny random models built
by transformers from a config and converted to GGUF by llama.cpp's convert_hf_to_gguf.py
(tests/support/moe_references.py; committed under tests/support/files/moe/). toygraph's loss on the GGUF
equals transformers' on the Hugging Face weights, 3 LoRA steps on the attention equal
torch + PEFT AdamW, and the exported PEFT adapter reproduces toygraph's adapted loss.
Each family feature the fixtures claim to exercise is shown to matter: the reference
with it changed is far (> 1e-3) from toygraph.

gpt-oss's YaRN: llama.cpp floors and ceils the correction range (ggml_rope_yarn_corr_dims;
transformers' rope parameter "truncate": true), and the GGUF has no key saying otherwise,
so toygraph does too and the reference config says truncate: true. transformers'
GptOssConfig default (and OpenAI's reference) is truncate: false; on this fixture that
reference differs by ~1e-3 (test_yarn_truncation_follows_llama_cpp)."""
import numpy as np
import pytest

from support.moe_references import MODELS, gguf_path, random_tokens, reference_model, requantize
from test_arch_models import reference_loss
from test_llama import assert_attention_is_token_major, toygraph_loss
from test_peft_reference import _report_and_check, random_lora, rel, train_both
from toygraph.adapters.files import save_peft
from toygraph.core.graph import Graph
from toygraph.errors import GraphError
from toygraph.inference.language_model import LanguageModel
from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder
from toygraph.models.model import GGUFModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.reference
ATTENTION = ("q", "k", "v", "o")
NAMES = list(MODELS)


def _reference(name):
    return lambda path: reference_model(name)


def test_the_qwen3moe_fixture_exercises_what_it_claims():
    cfg = GGUFModel(gguf_path("qwen3moe")).config
    assert 4 <= cfg.n_expert <= 8 and cfg.n_expert_used == 2 and cfg.experts.norm_weights
    assert cfg.n_head_kv < cfg.n_head and cfg.head_dim * cfg.n_head != cfg.n_embd
    # Every expert is chosen by some token, and no choice is a near tie (a rounding
    # difference cannot flip it between toygraph and the reference).
    model = reference_model("qwen3moe")
    tokens = torch.tensor(random_tokens(cfg.n_vocab), dtype=torch.long)
    seen, gaps, weights = set(), [], []

    def record(module, inputs, outputs):   # the router's (logits, weights, ids)
        logits, _, ids = outputs
        seen.update(ids.flatten().tolist())
        top = logits.sort(-1, descending=True).values
        gaps.append((top[:, 1] - top[:, 2]).min().item())
        weights.append(outputs[1][:, 1].median().item())

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    assert seen == set(range(cfg.n_expert)) and min(gaps) > 1e-4
    assert min(weights) > 0.1   # the second expert's weight, median over tokens: it counts


@pytest.mark.parametrize("name", NAMES)
def test_loss_matches_transformers(name):
    path = gguf_path(name)
    tokens = random_tokens(GGUFModel(path).config.n_vocab)
    mine, ref = toygraph_loss(path, tokens), reference_loss(reference_model(name), tokens)
    print(f"{name}: toygraph {mine:.7f} transformers {ref:.7f} rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_is_token_major(name):
    """gpt-oss's sinks and windows, Qwen3-MoE's q/k norms: no permute around attention."""
    assert_attention_is_token_major(gguf_path(name))


def test_the_gpt_oss_fixture_exercises_what_it_claims():
    cfg = GGUFModel(gguf_path("gpt-oss")).config
    assert 4 <= cfg.n_expert <= 8 and cfg.n_expert_used == 2 and cfg.n_head_kv < cfg.n_head
    window = cfg.attention[0].window
    assert [a.window for a in cfg.attention] == [window, 0] and 0 < window < 16
    assert len(set(cfg.rope_yarn)) > 3     # extrapolated, blended and scaled pairs
    assert all(a.bias and a.sinks and a.out_bias for a in cfg.attention)


def test_the_qwen2moe_fixture_exercises_what_it_claims():
    """Qwen2-MoE is Qwen2's attention and a mixture with a shared expert, recombined from
    existing parts by one Family entry: biases on q/k/v, softmax top-2 weights not
    renormalised, a shared expert of its own width gated per token."""
    cfg = GGUFModel(gguf_path("qwen2moe")).config
    moe = cfg.experts
    assert all(layer.ffn == moe for layer in cfg.layers) and cfg.qkv_bias
    assert (moe.count, moe.used, moe.router, moe.norm_weights) == (6, 2, "softmax_topk", False)
    assert moe.shared.width == 48 != moe.width and cfg.n_head_kv < cfg.n_head
    # the shared expert's gate takes values across (0, 1) on these tokens, not a constant
    model = reference_model("qwen2moe")
    tokens = torch.tensor(random_tokens(cfg.n_vocab), dtype=torch.long)
    gates = []
    hooks = [layer.mlp.shared_expert_gate.register_forward_hook(
        lambda m, i, o: gates.append(torch.sigmoid(o).flatten())) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    g = torch.cat(gates)
    assert g.min() < 0.3 and g.max() > 0.7


def _set(attr, value):
    def change(model):
        for layer in model.model.layers:
            obj = layer
            for part in attr.split(".")[:-1]:
                obj = getattr(obj, part)
            setattr(obj, attr.split(".")[-1], value)
    return change


def _fill(param, value):
    def change(model):
        with torch.no_grad():
            for layer in model.model.layers:
                eval(f"layer.{param}").fill_(value)
    return change


def _config(**kw):
    return lambda name: transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path(name).parent), dtype=torch.float32, **kw).eval()


YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 512}
CHANGES = {   # (family, what): the reference with it changed (a model, or a change to one)
    ("qwen3moe", "top-k weights not renormalised"): _set("mlp.gate.norm_topk_prob", False),
    ("qwen2moe", "top-k weights renormalised"): _set("mlp.gate.norm_topk_prob", True),
    ("qwen2moe", "no shared expert"): _fill("mlp.shared_expert.down_proj.weight", 0.0),
    ("qwen2moe", "shared expert not gated"): _fill("mlp.shared_expert_gate.weight", 0.0),
    ("gpt-oss", "no attention sinks"): _fill("self_attn.sinks", -1e9),
    ("gpt-oss", "no router bias"): _fill("mlp.router.bias", 0.0),
    ("gpt-oss", "no gate/up expert biases"): _fill("mlp.experts.gate_up_proj_bias", 0.0),
    ("gpt-oss", "no down expert biases"): _fill("mlp.experts.down_proj_bias", 0.0),
    ("gpt-oss", "no sliding window"): _config(sliding_window=1000),
    ("gpt-oss", "no SwiGLU clamp"): _config(swiglu_limit=1000.0),
    ("gpt-oss", "no YaRN"): _config(rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
}


@pytest.mark.parametrize("name,what", sorted(CHANGES))
def test_each_family_feature_matters(name, what):
    """Without ``what`` the reference is far from toygraph: the fixture exercises it."""
    path = gguf_path(name)
    tokens = random_tokens(GGUFModel(path).config.n_vocab)
    change = CHANGES[name, what]
    if change.__name__ == "<lambda>":      # a reference built from a changed config
        model = change(name)
    else:
        model = reference_model(name)
        change(model)
    assert rel(toygraph_loss(path, tokens), reference_loss(model, tokens)) > 1e-3


def test_yarn_truncation_follows_llama_cpp():
    """transformers' untruncated YaRN correction range (GptOssConfig's default) is
    ~1e-3 away on this fixture; the truncated one (llama.cpp's) is the parity reference."""
    path = gguf_path("gpt-oss")
    tokens = random_tokens(GGUFModel(path).config.n_vocab)
    untruncated = _config(rope_parameters={**YARN, "truncate": False})("gpt-oss")
    mine = toygraph_loss(path, tokens)
    print(f"untruncated YaRN reference: rel {rel(mine, reference_loss(untruncated, tokens)):.2e}")
    assert rel(mine, reference_loss(untruncated, tokens)) > 3e-4


@pytest.mark.parametrize("name", NAMES)
def test_lora_steps_match_peft(name, tmp_path):
    path = gguf_path(name)
    tokens = random_tokens(GGUFModel(path).config.n_vocab, seq=12)
    mine, ref, norms = train_both(path, tmp_path, targets=ATTENTION, rank=4, alpha=8,
                                  tokens=tokens, n_prompt=3, steps=3, reference=_reference(name))
    _report_and_check(name, mine, ref, norms, 0.5)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("targets,b_std", [   # the experts: tests/adapters/test_moe_lora.py
    (ATTENTION, 0.5), (("gate_up_exps", "down_exps"), 1.0), (("down_exps",), 1.0),
    (("o", "gate_up_exps"), 1.0)])
def test_exported_peft_adapter_reproduces_the_loss(name, targets, b_std, tmp_path):
    path = gguf_path(name)
    cfg = GGUFModel(path).config
    save_peft(tmp_path, random_lora(cfg, targets, 4, b_std=b_std), cfg, rank=4, alpha=8,
              targets=targets)
    tokens = random_tokens(cfg.n_vocab)
    mine, _ = LanguageModel(path, adapter_dir=tmp_path).loss(tokens.tolist())
    base, _ = LanguageModel(path).loss(tokens.tolist())
    ref = reference_loss(peft.PeftModel.from_pretrained(reference_model(name), str(tmp_path)),
                         tokens)
    print(f"{name} {targets}: base {base:.7f} adapter: toygraph {mine:.7f} peft {ref:.7f} "
          f"rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4
    # The adapter moves the loss far past that tolerance, so the agreement says something.
    # 20x: Qwen2-MoE's routed experts weigh unrenormalised probabilities (the top 2 of 6
    # sum to well under 1) beside a shared expert, so their adapters move its loss less
    # (42x for gate_up + down here; the other families' move it over 100x).
    assert abs(mine - base) > 20 * 1e-4 * ref


def test_dense_ffn_targets_are_refused_on_an_all_experts_model():
    cfg = GGUFModel(gguf_path("qwen3moe")).config
    with pytest.raises(GraphError, match=r"LoRA targets \['gate', 'down'\] name no weight"):
        build_decoder(Graph(), cfg, WeightSource(mode="scratch"), batch=1, seq_len=4,
                      lora=LoraConfig(targets=("q", "gate", "down")))


def _mxfp4_reference(path):
    """The gpt-oss reference with its experts set to the MXFP4 file's values, decoded by
    gguf.quants.dequantize and put back in transformers' layout (the converter's inverse:
    gate_up_proj [E, D, 2F] interleaves gate and up columns; down_proj is [E, F, D])."""
    import gguf
    import gguf.quants
    reader = gguf.GGUFReader(path)
    model = reference_model("gpt-oss")

    def weights(name):
        t = next(t for t in reader.tensors if t.name == name)
        assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        return torch.tensor(deq.reshape([int(x) for x in reversed(t.shape)]).transpose(0, 2, 1))

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            ex.gate_up_proj[:, :, ::2] = weights(f"blk.{i}.ffn_gate_exps.weight")
            ex.gate_up_proj[:, :, 1::2] = weights(f"blk.{i}.ffn_up_exps.weight")
            ex.down_proj[:] = weights(f"blk.{i}.ffn_down_exps.weight")
    return model


def test_gpt_oss_with_mxfp4_experts_matches_transformers(tmp_path):
    """Experts in MXFP4, as gpt-oss GGUFs ship them (quantized here by gguf-py): toygraph
    reads the blocks, transformers gets gguf-py's decoding of them."""
    path = requantize("gpt-oss", tmp_path / "mxfp4.gguf", {"_exps.weight": "mxfp4"})
    tokens = random_tokens(GGUFModel(path).config.n_vocab)
    mine, ref = toygraph_loss(path, tokens), reference_loss(_mxfp4_reference(path), tokens)
    f32 = toygraph_loss(gguf_path("gpt-oss"), tokens)
    print(f"gpt-oss mxfp4: toygraph {mine:.7f} transformers {ref:.7f} (f32 experts {f32:.7f})")
    assert rel(mine, ref) <= 1e-4 and rel(mine, f32) > 1e-3


# --- generation and the KV cache ---------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_cached_generation_matches_the_full_window_and_transformers(name):
    """24 greedy tokens (past gpt-oss's window of 6): the KV cache's decode (sinks as the
    cache's extra row) and the full-window path give transformers' own greedy tokens."""
    from test_kvcache import check_paths_agree
    path = gguf_path(name)
    lm = LanguageModel(path)
    ids = lm.tokenizer.encode("the cat sat on the mat")
    tokens = check_paths_agree(lm, ids, 24)
    with torch.no_grad():
        out = reference_model(name).generate(torch.tensor([ids]), max_new_tokens=24,
                                             do_sample=False, eos_token_id=None)
    assert tokens == out[0, len(ids):].tolist()
    assert len(set(tokens)) > 3


def test_cached_gpt_oss_on_the_cuda_kernels(monkeypatch):
    """The CUDA backend (host executor) with the cache against numpy's full window."""
    from test_kvcache import greedy_steps, normwise
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    path = gguf_path("gpt-oss")
    cpu, cuda = LanguageModel(path), LanguageModel(path, backend="cuda")
    ids = cpu.tokenizer.encode("the cat sat on the mat")
    got, got_logits = greedy_steps(cuda, ids, 10, kv_cache=True)
    want, want_logits = greedy_steps(cpu, ids, 10, kv_cache=False)
    assert got == want and normwise(got_logits, want_logits) <= 1e-4


# --- export: an attention adapter merged into a MoE GGUF ----------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_export_merges_an_attention_adapter_into_a_moe_gguf(name, tmp_path):
    """``toygraph export`` on a MoE file (gpt-oss with its experts in MXFP4): q/k/v/o
    merged, router, experts (their MXFP4 blocks), sinks and metadata carried over byte
    for byte; the merged file alone computes base + adapter, and transformers + PEFT on
    the same weights agrees."""
    from test_export import check_carried_over
    from toygraph.adapters.merge import export_merged
    path = gguf_path(name)
    if name == "gpt-oss":
        path = requantize(name, tmp_path / "mxfp4.gguf", {"_exps.weight": "mxfp4"})
    cfg = GGUFModel(path).config
    lora = random_lora(cfg, ATTENTION, 4, b_std=0.5)
    save_peft(tmp_path / "run", lora, cfg, rank=4, alpha=8, targets=ATTENTION)
    merged = export_merged(path, tmp_path / "run", tmp_path / "merged.gguf", "f32")
    check_carried_over(path, merged, set(lora), "f32")
    tokens = random_tokens(cfg.n_vocab)
    mine, _ = LanguageModel(merged).loss(tokens.tolist())
    adapted, _ = LanguageModel(path, adapter_dir=tmp_path / "run").loss(tokens.tolist())
    base = _mxfp4_reference(path) if name == "gpt-oss" else reference_model(name)
    ref = reference_loss(peft.PeftModel.from_pretrained(base, str(tmp_path / "run")), tokens)
    print(f"{name}: merged {mine:.7f} base+adapter {adapted:.7f} transformers+PEFT {ref:.7f}")
    assert rel(mine, adapted) <= 1e-5 and rel(mine, ref) <= 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_gguf_adapter_uses_llama_cpp_names(name, tmp_path):
    """A llama.cpp GGUF-LoRA of the attention targets, checked by llama.cpp's rules
    against the MoE base file."""
    from toygraph.adapters.files import check_gguf_adapter, save_gguf_adapter
    path = gguf_path(name)
    cfg = GGUFModel(path).config
    out = save_gguf_adapter(tmp_path / "a.gguf", random_lora(cfg, ATTENTION, 2), cfg, alpha=4,
                            base_arch=cfg.arch)
    info = check_gguf_adapter(out, path)
    assert set(info["tensors"]) == {f"blk.{i}.{p}.weight" for i in range(cfg.n_layer)
                                    for p in ("attn_q", "attn_k", "attn_v", "attn_output")}


@pytest.mark.parametrize("name", NAMES)
def test_batched_generation_rows_are_one_row_generation(name):
    """GRPO's sampler on both families (gpt-oss: sinks as the caches' extra row, windows
    of 6 passed), each row of prompts of different lengths against the one-row cache."""
    from test_batched import assert_rows_are_one_row_generation
    assert_rows_are_one_row_generation(LanguageModel(gguf_path(name)))


@pytest.mark.parametrize("name", NAMES)
def test_a_shared_prefill_gives_each_row_its_own_tokens(name):
    """One prefill per distinct prompt (gpt-oss: the sink row stays unwritten)."""
    from test_batched import assert_shared_prefill_is_each_rows_own
    assert_shared_prefill_is_each_rows_own(LanguageModel(gguf_path(name)))


def test_batched_gpt_oss_on_the_cuda_kernels(monkeypatch):
    from test_batched import PROMPTS, _batched
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    lm = LanguageModel(gguf_path("gpt-oss"))
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS[:3]]
    want = _batched(lm, prompts).generate(prompts, 8)
    assert _batched(lm, prompts, backend="cuda").generate(prompts, 8) == want
