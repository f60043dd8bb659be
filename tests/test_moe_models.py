"""Mixture-of-experts families against independent references: tiny random models built
by transformers from a config and converted to GGUF by llama.cpp's convert_hf_to_gguf.py
(tests/moe_references.py; committed under tests/data/moe/). toygraph's loss on the GGUF
equals transformers' on the Hugging Face weights, 3 LoRA steps on the attention equal
torch + PEFT AdamW, and the exported PEFT adapter reproduces toygraph's adapted loss."""
import numpy as np
import pytest

from moe_references import MODELS, gguf_path, random_tokens, reference_model
from test_arch_models import reference_loss
from test_llama import toygraph_loss
from test_peft_reference import _report_and_check, random_lora, rel, train_both
from toygraph.adapters.files import save_peft
from toygraph.core.graph import Graph
from toygraph.errors import GraphError
from toygraph.inference.language_model import LanguageModel
from toygraph.models.decoder import LoraConfig, build_decoder
from toygraph.models.model import GGUFModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.reference
ATTENTION = ("q", "k", "v", "o")
NAMES = list(MODELS)


def _reference(name):
    return lambda path: reference_model(name)


def test_the_fixtures_exercise_what_they_claim():
    cfg = GGUFModel(gguf_path("qwen3moe")).config
    assert 4 <= cfg.n_expert <= 8 and cfg.n_expert_used == 2 and cfg.expert_weights_norm
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


def test_routing_weights_matter():
    """The reference without renormalised top-k weights is far from toygraph: the fixture
    exercises the family's weight normalisation well beyond the tolerance."""
    path = gguf_path("qwen3moe")
    tokens = random_tokens(GGUFModel(path).config.n_vocab)
    model = reference_model("qwen3moe")
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    assert rel(toygraph_loss(path, tokens), reference_loss(model, tokens)) > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_lora_steps_match_peft(name, tmp_path):
    path = gguf_path(name)
    tokens = random_tokens(GGUFModel(path).config.n_vocab, seq=12)
    mine, ref, norms = train_both(path, tmp_path, targets=ATTENTION, rank=4, alpha=8,
                                  tokens=tokens, n_prompt=3, steps=3, reference=_reference(name))
    _report_and_check(name, mine, ref, norms, 0.5)


@pytest.mark.parametrize("name", NAMES)
def test_exported_peft_adapter_reproduces_the_loss(name, tmp_path):
    path = gguf_path(name)
    cfg = GGUFModel(path).config
    save_peft(tmp_path, random_lora(cfg, ATTENTION, 4, b_std=0.5), cfg, rank=4, alpha=8,
              targets=ATTENTION)
    tokens = random_tokens(cfg.n_vocab)
    mine, _ = LanguageModel(path, adapter_dir=tmp_path).loss(tokens.tolist())
    base, _ = LanguageModel(path).loss(tokens.tolist())
    ref = reference_loss(peft.PeftModel.from_pretrained(reference_model(name), str(tmp_path)),
                         tokens)
    print(f"{name}: base {base:.7f} adapter: toygraph {mine:.7f} peft {ref:.7f}")
    assert rel(mine, ref) <= 1e-4
    assert abs(mine - base) > 100 * 1e-4 * ref


def test_dense_ffn_targets_are_refused_on_an_all_experts_model():
    cfg = GGUFModel(gguf_path("qwen3moe")).config
    with pytest.raises(GraphError, match=r"LoRA targets \['gate', 'down'\] name no weight"):
        build_decoder(Graph(), cfg, batch=1, seq_len=4, weights="scratch",
                      lora=LoraConfig(targets=("q", "gate", "down")))
