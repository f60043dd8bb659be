"""LoRA on the experts of the mixture-of-experts families (models/moe.py, adapters/experts.py):
one A/B per expert, stacked, applied to the tokens routed to it, against transformers + PEFT
(target_parameters on the fused mlp.experts.gate_up_proj / down_proj) on the tiny converted
models of tests/support/moe_references.py (the exported adapter's loss in PEFT: test_moe_models.py's
test_exported_peft_adapter_reproduces_the_loss); llama.cpp's GGUF-LoRA form checked by its loader's rules
and by merging it; the CUDA kernels (host executor) against numpy."""
import numpy as np
import pytest

from support.moe_references import MODELS, gguf_path, random_tokens, reference_model
from test_arch_models import reference_loss
from test_peft_reference import _report_and_check, random_lora, rel, train_both
from toygraph.adapters import experts
from toygraph.adapters.files import read_peft, save_peft
from toygraph.core.graph import Graph
from toygraph.errors import DataError, GraphError
from toygraph.inference.language_model import LanguageModel
from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder
from toygraph.models.model import GGUFModel

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.reference
NAMES = list(MODELS)
EXPERTS = ("gate_up_exps", "down_exps")


def _reference(name):
    return lambda path: reference_model(name)


def test_experts_names_both_expert_targets_and_refuses_what_peft_cannot_do():
    from toygraph.recipes import LoRA
    assert LoraConfig(targets=("q", "experts")).targets == ("q", "gate_up_exps", "down_exps")
    assert LoRA(targets=("experts", "down_exps")).targets == EXPERTS
    with pytest.raises(GraphError, match="experts .* neither DoRA nor dropout"):
        LoraConfig(targets=("experts",), dora=True)
    with pytest.raises(GraphError, match="experts .* neither DoRA nor dropout"):
        LoraConfig(targets=("down_exps",), lora_dropout=0.1)


def test_expert_targets_are_refused_on_a_dense_model(tiny_llama):
    cfg = GGUFModel(tiny_llama).config
    with pytest.raises(GraphError, match=r"LoRA targets \['gate_up_exps'\] name no weight"):
        build_decoder(Graph(), cfg, WeightSource(mode="scratch"), batch=1, seq_len=4,
                      lora=LoraConfig(targets=("q", "gate_up_exps")))


@pytest.mark.parametrize("name", NAMES)
def test_peft_layout_round_trips(name):
    """to_peft / from_peft are inverses, and PEFT's own reading of the layout (its
    get_delta_weight) gives toygraph's per-expert B[e] A[e], the gate/up rows where the
    family's transformers model reads them."""
    cfg = GGUFModel(gguf_path(name)).config
    lora = random_lora(cfg, EXPERTS, 3)
    for key, (a, b) in lora.items():
        a2, b2 = experts.to_peft(key, a, b, cfg)
        back = experts.from_peft(key, a2, b2, cfg, "here")
        assert np.array_equal(back[0], a) and np.array_equal(back[1], b)
        E, r = cfg.n_expert, 3
        # PEFT: A.reshape(E, r, in), B.reshape(out, r, E) -> delta[e] = B_e A_e [out, in]
        pa = a2.reshape(E, r, -1)
        pb = b2.reshape(b2.shape[0], r, E).transpose(2, 0, 1)
        delta = pb @ pa
        mine = b @ a                                        # [E, out, in], gguf rows
        if key.endswith("ffn_gate_up_exps.weight"):
            f = cfg.n_ff_exp
            gate, up = ((delta[:, 0::2], delta[:, 1::2]) if name == "gpt-oss"
                        else (delta[:, :f], delta[:, f:]))
            delta = np.concatenate([gate, up], axis=1)
        assert np.allclose(delta, mine, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_expert_lora_steps_match_peft(name, tmp_path):
    """3 AdamW steps with LoRA on the attention and every expert, against torch + PEFT
    (ParamWrapper LoRA on mlp.experts.gate_up_proj and down_proj); the router frozen."""
    path = gguf_path(name)
    tokens = random_tokens(GGUFModel(path).config.n_vocab, seq=12)
    keep = {}
    mine, ref, norms = train_both(path, tmp_path, targets=("q", "v", *EXPERTS), rank=4,
                                  alpha=8, tokens=tokens, n_prompt=3, steps=3,
                                  reference=_reference(name), keep=keep)
    _report_and_check(name, mine, ref, norms, 0.5)
    trained = [t.name for t in keep["recipe"].net.params]
    assert any("ffn_down_exps" in t for t in trained) and not any("gate_inp" in t for t in trained)
    wrapped = [n for n, _ in keep["model"].named_modules() if n.endswith("mlp.experts")]
    assert wrapped and all("ParamWrapper" in type(keep["model"].get_submodule(n)).__name__
                           for n in wrapped)


@pytest.mark.parametrize("name", NAMES)
def test_an_adapter_saved_by_peft_reads_back(name, tmp_path):
    """PEFT's own save of a target_parameters adapter (its key nesting, its layout) read by
    toygraph gives PEFT's loss."""
    model = reference_model(name)
    conf = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                           init_lora_weights=False)
    torch.manual_seed(0)
    pm = peft.get_peft_model(model, conf)
    pm.save_pretrained(tmp_path)
    a = read_peft(tmp_path, GGUFModel(gguf_path(name)).config)
    assert a.targets == ("k", "gate_up_exps", "down_exps") and a.rank == 2
    tokens = random_tokens(model.config.vocab_size)
    mine, _ = LanguageModel(gguf_path(name), adapter_dir=tmp_path).loss(tokens.tolist())
    ref = reference_loss(pm.eval(), tokens)
    print(f"{name}: toygraph {mine:.7f} peft {ref:.7f} rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4


def test_a_peft_expert_adapter_with_a_bad_shape_is_refused(tmp_path):
    cfg = GGUFModel(gguf_path("qwen3moe")).config
    save_peft(tmp_path, random_lora(cfg, ("down_exps",), 2), cfg, rank=2, alpha=4,
              targets=("down_exps",))
    from safetensors.numpy import load_file, save_file
    f = tmp_path / "adapter_model.safetensors"
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("lora_A.weight"))
    t[key] = t[key][:-1]
    save_file(t, str(f))
    with pytest.raises(DataError, match="not PEFT's"):
        read_peft(tmp_path, cfg)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_adapter_holds_3d_expert_tensors_as_llama_cpp_reads_them(name, tmp_path):
    """llama.cpp's build_lora_mm_id form: lora_a ne [n_in, r, E], lora_b ne [r, n_out, E] per
    expert tensor, gate and up each their own (the shared A twice), checked by llama.cpp's
    loader rules against the base; merging that file equals merging the PEFT adapter."""
    from toygraph.adapters.files import check_gguf_adapter, load_gguf_adapter, save_gguf_adapter
    path = gguf_path(name)
    cfg = GGUFModel(path).config
    lora = random_lora(cfg, ("k", *EXPERTS), 2)
    out = save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=4, base_arch=cfg.arch)
    info = check_gguf_adapter(out, path)
    assert set(info["tensors"]) == {f"blk.{i}.{p}.weight" for i in range(cfg.n_layer) for p in
                                    ("attn_k", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    import gguf
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in gguf.GGUFReader(out).tensors}
    E, f, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    assert shapes["blk.0.ffn_up_exps.weight.lora_a"] == (d, 2, E)
    assert shapes["blk.0.ffn_up_exps.weight.lora_b"] == (2, f, E)
    assert shapes["blk.0.ffn_down_exps.weight.lora_a"] == (f, 2, E)
    back, rank, _, _ = load_gguf_adapter(out, cfg)
    for key, (a, b) in experts.per_base_tensor(lora).items():
        assert np.array_equal(back[key][0], a) and np.array_equal(back[key][1], b)


def test_gguf_adapter_with_an_expert_tensor_of_the_wrong_expert_count_is_refused(tmp_path):
    from toygraph.adapters.files import check_gguf_adapter, save_gguf_adapter
    import gguf
    path = gguf_path("qwen3moe")
    cfg = GGUFModel(path).config
    lora = random_lora(cfg, ("down_exps",), 2)
    good = save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=4, base_arch=cfg.arch)
    reader = gguf.GGUFReader(good)
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", cfg.arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 4.0)
    for t in reader.tensors:   # one expert short
        w.add_tensor(t.name, np.array(t.data)[:-1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DataError, match="incorrect shape|want a="):
        check_gguf_adapter(tmp_path / "bad.gguf", path)


@pytest.mark.parametrize("name", NAMES)
def test_export_merges_expert_lora_into_the_expert_tensors(name, tmp_path):
    """``toygraph export`` of an expert adapter: each expert tensor gets W[e] + s B[e] A[e]
    (gate and up their halves of the shared adapter); the merged file alone computes
    base + adapter, from the PEFT directory and from the GGUF-LoRA file alike."""
    from toygraph.adapters.files import save_gguf_adapter
    from toygraph.adapters.merge import export_merged
    path = gguf_path(name)
    cfg = GGUFModel(path).config
    lora = random_lora(cfg, ("v", *EXPERTS), 4, b_std=0.5)
    save_peft(tmp_path / "run", lora, cfg, rank=4, alpha=8, targets=("v", *EXPERTS))
    gguf_adapter = save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=8, base_arch=cfg.arch)
    tokens = random_tokens(cfg.n_vocab)
    adapted, _ = LanguageModel(path, adapter_dir=tmp_path / "run").loss(tokens.tolist())
    for source in (tmp_path / "run", gguf_adapter):
        merged = export_merged(path, source, tmp_path / f"merged-{source.name}.gguf", "f32")
        got, _ = LanguageModel(merged).loss(tokens.tolist())
        print(f"{name} from {source.name}: merged {got:.7f} base+adapter {adapted:.7f}")
        assert rel(got, adapted) <= 1e-5


def test_expert_lora_step_on_the_cuda_kernels(monkeypatch, tmp_path):
    """One LoRA step on the experts through the CUDA backend (host executor): the grouped
    GEMMs of the adapters, forward and backward, against the numpy backend."""
    from toygraph.core.optimizer import hp_row
    from toygraph.recipes import LoRA, RecipeOptions
    from test_peft_reference import trainable_values
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    path = gguf_path("gpt-oss")
    model = GGUFModel(path)
    cfg = model.config
    lora = random_lora(cfg, EXPERTS, 2, b_std=0.3)
    tokens = random_tokens(cfg.n_vocab, batch=1, seq=8)
    labels = np.concatenate([tokens[:, 1:], np.full((1, 1), -1)], 1).astype(np.int32)
    positions = np.arange(8, dtype=np.int32)[None]
    got = {}
    for backend in ("cpu", "cuda"):
        recipe = LoRA(targets=EXPERTS, rank=2, alpha=4)
        recipe.realize(model, cfg, RecipeOptions(seq_len=8, batch=1, backend=backend))
        recipe.load_trainable(trainable_values(lora))
        loss = recipe.step(tokens[None], positions[None], labels[None], hp_row(1, 1e-2),
                           is_first=True)
        got[backend] = loss, recipe.trainable()
    (l_cpu, w_cpu), (l_cuda, w_cuda) = got["cpu"], got["cuda"]
    assert rel(l_cuda, l_cpu) <= 1e-5
    for key in w_cpu:
        moved = np.abs(w_cpu[key] - trainable_values(lora)[key]).max()
        assert moved > 0 and np.abs(w_cuda[key] - w_cpu[key]).max() <= 1e-4 * moved + 1e-7, key
