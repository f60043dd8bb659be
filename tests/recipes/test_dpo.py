"""The DPO/ORPO recipes' graphs (recipes/preference.py, dpo.py, orpo.py): the reference pass reads the base
weights the policy reads (no second copy), one realized graph runs on the CUDA backend
(host device) as on numpy, options are checked, gradient accumulation averages."""
import numpy as np
import pytest

from support.gradcheck import check_gradients
from test_dpo_reference import B, T, batches_for
from toygraph.errors import GraphError
from toygraph.models.model import GGUFModel
from toygraph.models.config import tensor_shapes
from toygraph.core.optimizer import hp_row
from toygraph.recipes import DPO, ORPO, LoRA, RecipeOptions

TARGETS = ("q", "v")


def _realize(recipe, path, **opts):
    m = GGUFModel(path)
    recipe.realize(m, m.config, RecipeOptions(seq_len=T, batch=opts.pop("batch", B), **opts))
    return recipe


def _weight_consts(recipe):
    names = set(tensor_shapes(recipe.model_cfg))
    return {t.name: t for t in recipe.sess.schedules["step"] if t.role == "const" and t.name in names}


def test_the_reference_pass_reads_the_same_base_weights_no_second_copy(tiny_llama):
    """A DPO graph of B pairs against an SFT graph of the same shape (2B sequences): the
    same base const tensors, each bound once, and the reference pass consumes them."""
    dpo = _realize(DPO(TARGETS, reference_adapter=True), tiny_llama)
    sft = _realize(LoRA(TARGETS), tiny_llama, batch=2 * B)
    mine, theirs = _weight_consts(dpo), _weight_consts(sft)
    assert set(mine) == set(theirs) == set(tensor_shapes(dpo.model_cfg))
    assert (sum(t.size for t in mine.values()) == sum(t.size for t in theirs.values()))
    assert len({t.id for t in dpo.graph.nodes if t.role == "const" and t.name in mine}) == len(mine)
    assert set(dpo.ref_net.weights.values()) == set(dpo.net.weights.values())
    # Every attention weight feeds two matmuls (policy and reference) in DPO, one in SFT.
    users = [t for t in dpo.graph.nodes if t.op == "matmul" and mine["blk.0.attn_k.weight"] in t.srcs]
    assert len(users) == 2
    # What DPO pins beyond SFT is adapters, moments, inputs and outputs: far less than the base.
    base = sum(dpo.sess.backend.arrays[t.id].nbytes for t in mine.values())
    extra = dpo.sess.plan.pinned_bytes - sft.sess.plan.pinned_bytes
    reference_adapter = sum(p.size * 4 for p in dpo.ref_net.params)
    print(f"base {base} B, DPO pins {extra} B more than SFT (reference adapter {reference_adapter} B)")
    assert extra < base / 4


def _two_steps(recipe, path) -> list[dict]:
    """The metrics of two steps on the first two pair batches of the fixture."""
    pos = np.tile(np.arange(T, dtype=np.int32), (1, 2 * B, 1))
    out = []
    for t, (tokens, labels) in enumerate(batches_for(path)[:2], start=1):
        recipe.step(tokens[None], pos, labels[None], hp_row(t, 1e-2), is_first=t == 1)
        out.append(dict(recipe.last_metrics))
    return out


@pytest.mark.parametrize("make", [lambda: DPO(TARGETS, beta=0.5, label_smoothing=0.1),
                                  lambda: ORPO(TARGETS, beta=0.5)])
def test_one_graph_runs_on_the_cuda_host_device_as_on_numpy(tiny_llama, monkeypatch, make):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    results = [_two_steps(_realize(make(), tiny_llama, init_scale=0.3, backend=backend),
                          tiny_llama) for backend in ("cpu", "cuda")]
    # 1e-4 relative, absolute below 1: rewards are small differences of log-prob sums
    # (~50 here) that f32 rounding moves by ~1e-6 whatever the rewards' own size.
    for a, b in zip(*results):
        assert a.keys() == b.keys()
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-4 * max(abs(b[k]), 1), (k, a[k], b[k])


def test_gradient_accumulation_averages_micro_batch_losses(tiny_llama):
    """k = 2 micro-batches make one step whose loss is the mean of the two, and whose
    update equals one of the k = 1 recipe stepping on each half's summed gradient."""
    batches = batches_for(tiny_llama)[:2]
    pos = np.tile(np.arange(T, dtype=np.int32), (2, 2 * B, 1))
    two = _realize(DPO(TARGETS, beta=0.5), tiny_llama, init_scale=0.3, grad_accum=2)
    tokens = np.stack([b[0] for b in batches])
    labels = np.stack([b[1] for b in batches])
    loss = two.step(tokens, pos, labels, hp_row(1, 1e-2), is_first=True)
    one = _realize(DPO(TARGETS, beta=0.5), tiny_llama, init_scale=0.3)
    singles = [one.evaluate(tk, pos[0], lb)[0] / (lb[:B] >= 0).any(1).sum() for tk, lb in batches]
    assert abs(loss - np.mean(singles)) <= 1e-6 * abs(loss)


def test_options_are_checked(tiny_llama):
    with pytest.raises(GraphError, match="beta must be a finite number > 0"):
        DPO(beta=0)
    with pytest.raises(GraphError, match="label_smoothing must be in"):
        DPO(label_smoothing=0.5)
    recipe = _realize(ORPO(TARGETS), tiny_llama)
    bad = np.zeros((1, B, T), np.int32)
    with pytest.raises(GraphError, match=r"2 \* batch \(chosen rows, then rejected\)"):
        recipe.step(bad, bad, bad, hp_row(1, 1e-3), is_first=True)


@pytest.fixture(params=[False, True], ids=["unfused_head", "fused_head"])
def fused_on_cpu(request, monkeypatch):
    """The preference log-probs through the unfused head (the CPU default) and through the
    fused one (linear_cross_entropy "none", as on CUDA), both on the numpy backend."""
    import toygraph.recipes.base as recipe_base
    monkeypatch.setattr(recipe_base, "FUSED_HEAD_ON_CPU", request.param)
    return request.param


def test_dpo_loss_gradient_through_the_whole_graph(tiny_llama, fused_on_cpu):
    """f64 finite differences of the DPO loss with label smoothing w.r.t. the adapters,
    through both passes (the reference with a frozen, different adapter of its own)."""
    recipe = DPO(TARGETS, beta=2.0, label_smoothing=0.2, reference_adapter=True)
    m = GGUFModel(tiny_llama)
    g = recipe.build_graph(m, m.config, RecipeOptions(seq_len=8, batch=1, init_scale=0.3))
    rng = np.random.default_rng(5)
    for p in recipe.net.params + recipe.ref_net.params:
        if p.name.endswith("lora_b"):
            p.data = rng.normal(size=p.shape) * 0.3
    tokens, labels = batches_for(tiny_llama)[0]
    tokens = np.concatenate([tokens[:1, :8], tokens[B:B + 1, :8]])
    labels = np.concatenate([labels[:1, :8], labels[B:B + 1, :8]])
    labels[:, 3:] = np.where(labels[:, 3:] < 0, 5, labels[:, 3:])
    params = [p for p in recipe.net.params if p.name.startswith("blk.0.")]
    inputs = {recipe.net.tokens: tokens, recipe.net.positions: np.tile(np.arange(8), (2, 1)),
              recipe.labels: labels.reshape(-1), recipe.pair_weight: np.ones(1)}
    assert check_gradients(g, recipe.loss, params, inputs, max_elems=8) <= 1e-6
    assert any(t.op == "linear_cross_entropy" for t in g.nodes) == fused_on_cpu


@pytest.mark.parametrize("make", [lambda: DPO(TARGETS, beta=0.5, label_smoothing=0.1),
                                  lambda: ORPO(TARGETS, beta=0.5)])
def test_on_cuda_no_vocabulary_sized_logits_exist(tiny_llama, make):
    """The CUDA graph (built, not run) takes both passes' log-probs from the fused head:
    no [2B * T, vocab] tensor forward or backward, one per-row linear_cross_entropy per
    pass (DPO: policy and reference; ORPO: the policy)."""
    from toygraph.core.optimizer import build_training
    recipe = make()
    m = GGUFModel(tiny_llama)
    g = recipe.build_graph(m, m.config, RecipeOptions(seq_len=T, batch=B, backend="cuda"))
    build_training(recipe.loss, recipe.net.params)
    rows, vocab = 2 * B * T, m.config.n_vocab
    assert not [t for t in g.nodes if t.shape[-1:] == (vocab,) and t.size >= rows * vocab]
    heads = [t for t in g.nodes if t.op == "linear_cross_entropy"]
    assert [t.attrs["reduction"] for t in heads] == ["none"] * (2 if isinstance(recipe, DPO) else 1)
    assert not [t for t in g.nodes if t.op in ("token_logprobs", "token_logprobs_back")]
    assert [t.op for t in g.nodes if t.op == "linear_cross_entropy_back"] == \
        ["linear_cross_entropy_back"]   # the policy's; the reference gets no gradient


@pytest.mark.parametrize("make", [lambda: DPO(TARGETS, beta=0.5, label_smoothing=0.1),
                                  lambda: ORPO(TARGETS, beta=0.5)])
def test_the_fused_head_trains_as_the_unfused_one(tiny_llama, monkeypatch, make):
    """Two steps on the numpy backend with the fused head and with the unfused one: every
    metric within f32 rounding (the log-probs sum the vocabulary in another order)."""
    import toygraph.recipes.base as recipe_base
    results = []
    for fused in (False, True):
        monkeypatch.setattr(recipe_base, "FUSED_HEAD_ON_CPU", fused)
        recipe = _realize(make(), tiny_llama, init_scale=0.3)
        assert any(t.op == "linear_cross_entropy" for t in recipe.graph.nodes) == fused
        results.append(_two_steps(recipe, tiny_llama))
    for a, b in zip(*results):
        assert a.keys() == b.keys()
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(b[k]), 1), (k, a[k], b[k])
