"""The LoRA variants (models/decoder.LoraConfig: rsLoRA, LoRA+, DoRA) against torch + PEFT
with the same option: 3 training steps from the same init agree within 1e-4, and the
adapter toygraph exports after them gives toygraph's loss in PEFT within 1e-4 (and
toygraph's own evaluation of the imported adapter gives it too)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_peft_reference import ALL, peft_model, rel, token_batch, train_both  # noqa: E402

from toygraph.adapters.files import read_peft, save_gguf_adapter, save_peft  # noqa: E402
from toygraph.errors import DataError  # noqa: E402
from toygraph.inference.language_model import LanguageModel  # noqa: E402
from toygraph.training.checkpoints import lora_arrays  # noqa: E402

pytestmark = pytest.mark.reference
STEPS = 3


def _peft_loss(model, tokens, labels) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.double()
    target = torch.tensor(np.where(labels < 0, -100, labels), dtype=torch.long).reshape(-1)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target,
                                             ignore_index=-100).item()


def check_variant(path, tmp_path, rank=4, alpha=8, lr=2e-3, peft_hook=None, **variant):
    """3 steps vs PEFT; then the trained adapter exported, read back by PEFT and toygraph."""
    tokens = token_batch(path, True, 24)
    keep = {}
    mine, ref, norms = train_both(path, tmp_path / "init", targets=ALL, rank=rank, alpha=alpha,
                                  tokens=tokens, n_prompt=6, steps=STEPS, lr=lr, keep=keep,
                                  peft_hook=peft_hook, **variant)
    errs = [rel(a, b) for a, b in zip(mine, ref)]
    print(f"{variant}: toygraph {np.round(mine, 6).tolist()} torch {np.round(ref, 6).tolist()} "
          f"max rel {max(errs):.2e}")
    assert max(errs) <= 1e-4
    assert abs(mine[-1] - mine[0]) > 1e-3          # the steps trained

    recipe, cfg, labels = keep["recipe"], keep["cfg"], keep["labels"]
    B, T = tokens.shape
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    total, count = recipe.evaluate(tokens, positions, labels)
    trained = total / count
    out = tmp_path / "trained"
    save_peft(out, lora_arrays(recipe), cfg, rank=rank, alpha=alpha, targets=ALL,
              rslora=variant.get("rslora", False), lora_dropout=variant.get("lora_dropout", 0.0))
    model = peft_model(path, out)
    theirs = _peft_loss(model, tokens, labels)
    print(f"  exported: toygraph {trained:.7f} peft {theirs:.7f} (rel {rel(trained, theirs):.1e})")
    assert rel(trained, theirs) <= 1e-4
    assert abs(trained - mine[0]) > 1e-3               # the trained adapter is not the init's
    # imported for eval/generate: LanguageModel's loss (every next token) is PEFT's
    every = np.concatenate([tokens[:, 1:], np.full((B, 1), -1)], 1)
    ours, _ = LanguageModel(path, adapter_dir=out).loss(tokens.tolist())
    assert rel(ours, _peft_loss(model, tokens, every)) <= 1e-4
    return out, mine


def test_rslora_trains_and_exports_as_peft_does(tiny_llama, tmp_path):
    out, _ = check_variant(tiny_llama, tmp_path, rank=4, alpha=8, rslora=True)
    adapter = read_peft(out, LanguageModel(tiny_llama).cfg)
    assert adapter.rslora and adapter.scaling == 8 / 2          # alpha / sqrt(4)


def test_rslora_gguf_adapter_carries_the_sqrt_rank_scale(tiny_llama, tmp_path):
    """llama.cpp scales by adapter.lora.alpha / rank: rsLoRA's alpha / sqrt(r) needs
    alpha * sqrt(r) in the file."""
    import gguf
    from test_peft_reference import random_lora
    cfg = LanguageModel(tiny_llama).cfg
    path = save_gguf_adapter(tmp_path / "a.gguf", random_lora(cfg, ("q",), 4), cfg, alpha=8,
                             base_arch=cfg.arch, rslora=True)
    alpha = gguf.GGUFReader(str(path)).get_field("adapter.lora.alpha").contents()
    assert alpha / 4 == pytest.approx(8 / 2)


def test_lora_plus_trains_as_peft_loraplus_optimizer(tiny_llama, tmp_path):
    _, mine = check_variant(tiny_llama, tmp_path, lora_plus_ratio=16.0, lr=5e-4)
    plain, _, _ = train_both(tiny_llama, tmp_path / "plain", targets=ALL, rank=4, alpha=8,
                             tokens=token_batch(tiny_llama, True, 24), n_prompt=6, steps=STEPS,
                             lr=5e-4)
    assert rel(mine[-1], plain[-1]) > 1e-3   # the ratio changed the training


def test_dora_trains_and_exports_as_peft_does(tiny_llama, tmp_path):
    out, _ = check_variant(tiny_llama, tmp_path, dora=True)
    adapter = read_peft(out, LanguageModel(tiny_llama).cfg)
    assert adapter.dora and all(len(pair) == 3 for pair in adapter.lora.values())


def test_dora_plus_lora_plus_rslora_together(tiny_qwen2, tmp_path):
    """All three at once, on a model with q/k/v biases (DoRA scales W x + s B A x, then
    adds the bias); PEFT puts DoRA's magnitudes in LoRA+'s B group."""
    check_variant(tiny_qwen2, tmp_path, dora=True, rslora=True, lora_plus_ratio=4.0, lr=1e-3)


def test_dora_magnitude_starts_at_the_row_norms_of_w(tiny_llama):
    """PEFT's init: m = ||W||_row (B = 0); so the DoRA model starts as the base model."""
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    model = GGUFModel(tiny_llama)
    recipe = LoRA(targets=("q", "down"), rank=2, dora=True)
    recipe.realize(model, model.config, RecipeOptions(seq_len=8, batch=1))
    for name, m in recipe.net.magnitudes.items():
        w = model.tensor(name).dequantize()
        np.testing.assert_allclose(recipe.sess.download(m), np.linalg.norm(w, axis=1), rtol=1e-6)


def test_dora_gguf_adapter_is_refused_with_the_merged_export_named(tiny_llama, tmp_path):
    from test_peft_reference import random_lora
    cfg = LanguageModel(tiny_llama).cfg
    lora = {n: (a, b, np.ones(b.shape[0], np.float32))
            for n, (a, b) in random_lora(cfg, ("q",), 2).items()}
    with pytest.raises(DataError, match="no DoRA; export the merged model"):
        save_gguf_adapter(tmp_path / "a.gguf", lora, cfg, alpha=4, base_arch=cfg.arch)


@pytest.mark.parametrize("rslora", [False, True])
def test_dora_merged_export_matches_peft(tiny_llama, tmp_path, rslora):
    """W' = m / ||W + s B A||_row * (W + s B A) merged into an f32 GGUF gives PEFT's loss,
    in toygraph and in transformers."""
    from test_export import hf_loss, hf_model
    from test_peft_reference import random_lora
    from toygraph.adapters.merge import export_merged
    cfg = LanguageModel(tiny_llama).cfg
    rng = np.random.default_rng(2)
    lora = {}
    for n, (a, b) in random_lora(cfg, ALL, 4, b_std=0.5).items():
        w = base_weight(tiny_llama, n)
        lora[n] = (a, b, (np.linalg.norm(w, axis=1) * np.exp(0.4 * rng.normal(size=w.shape[0])))
                   .astype(np.float32))
    save_peft(tmp_path / "run", lora, cfg, rank=4, alpha=8, targets=ALL, rslora=rslora)
    tokens = token_batch(tiny_llama, True, 16)
    reference = hf_loss(peft_model(tiny_llama, tmp_path / "run"), tokens)
    base, _ = LanguageModel(tiny_llama).loss(tokens.tolist())
    assert abs(reference - base) > 20 * 1e-4 * reference     # the adapter matters (>20x tol)
    merged = export_merged(tiny_llama, tmp_path / "run", tmp_path / "m.gguf", "f32")
    mine, _ = LanguageModel(merged).loss(tokens.tolist())
    hf = hf_loss(hf_model(merged), tokens)
    print(f"DoRA merged (rslora={rslora}): toygraph {mine:.7f} transformers {hf:.7f} "
          f"PEFT {reference:.7f}")
    assert rel(mine, reference) <= 1e-4 and rel(hf, reference) <= 1e-4


def base_weight(path, name):
    from toygraph.models.model import GGUFModel
    return GGUFModel(path).tensor(name).dequantize()


# --- the training run: options, files, resume, --adapter-init ------------------------------
def run_and_resume(model, tmp_path, **kw):
    """4 steps straight, and 2 steps, Ctrl-C, resume, 2 more: (the data, the step losses
    of each); the straight run is in tmp_path / "full"."""
    from test_run import _stop_after, cfg_for, events, write_chat_data
    from toygraph.training import run_training
    data = write_chat_data(tmp_path / "chat.jsonl")
    kw = dict(steps=4, save_every=2, **kw)
    run_training(cfg_for(model, data, tmp_path / "full", **kw))
    straight = [e["loss"] for e in events(tmp_path / "full") if e["event"] == "step"]
    part = tmp_path / "part"
    _stop_after(cfg_for(model, data, part, **kw), 2)
    run_training(cfg_for(model, data, part, resume=str(part / "checkpoints" / "step-000002"),
                         **kw))
    resumed = {e["step"]: e["loss"] for e in events(part) if e["event"] == "step"}
    return data, straight, [resumed[s] for s in range(1, 5)]


def test_a_dora_rslora_lora_plus_run_resumes_exactly_and_writes_its_adapter(tiny_qwen2,
                                                                              tmp_path):
    from test_run import cfg_for
    from toygraph.training import run_training
    data, straight, resumed = run_and_resume(tiny_qwen2, tmp_path, dora=True, rslora=True,
                                             lora_plus_ratio=4.0)
    assert resumed == straight       # bit-exact
    out = tmp_path / "full"
    config = __import__("json").loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    assert not (out / "adapter.gguf").exists() and not (out / "Modelfile").exists()
    # the result starts another run (--adapter-init) only with the same variants
    run_training(cfg_for(tiny_qwen2, data, tmp_path / "again", adapter_init=str(out), steps=1,
                         dora=True, rslora=True))
    with pytest.raises(DataError, match="use_dora=true; the run does not ask for --dora"):
        run_training(cfg_for(tiny_qwen2, data, tmp_path / "plain", adapter_init=str(out),
                             steps=1, rslora=True))


def test_variant_options_are_for_the_lora_recipe(tiny_llama, tmp_path):
    from test_run import cfg_for
    from toygraph.errors import ToygraphError
    for kw in (dict(dora=True), dict(rslora=True), dict(lora_plus_ratio=2.0)):
        with pytest.raises(ToygraphError, match="is for --recipe lora, not dpo"):
            cfg_for(tiny_llama, "d.jsonl", tmp_path, recipe="dpo", **kw).validate()


def test_dora_generation_with_the_kv_cache_is_the_merged_models(tiny_llama, tmp_path):
    """generate (KV cache, prefill then one-token steps sharing the magnitudes) on a DoRA
    adapter gives the tokens of its merged f32 model, and differs from the base's."""
    from test_peft_reference import random_lora
    from toygraph.adapters.merge import export_merged
    cfg = LanguageModel(tiny_llama).cfg
    rng = np.random.default_rng(4)
    lora = {n: (a, b, (np.linalg.norm(base_weight(tiny_llama, n), axis=1)
                       * np.exp(0.4 * rng.normal(size=b.shape[0]))).astype(np.float32))
            for n, (a, b) in random_lora(cfg, ALL, 4, b_std=0.5).items()}
    save_peft(tmp_path / "run", lora, cfg, rank=4, alpha=8, targets=ALL)
    merged = export_merged(tiny_llama, tmp_path / "run", tmp_path / "m.gguf", "f32")
    prompt = list(range(3, 9))
    ids = [LanguageModel(p, adapter_dir=d).generate(prompt, max_new_tokens=12, stop=())
           for p, d in ((tiny_llama, tmp_path / "run"), (merged, None), (tiny_llama, None))]
    assert ids[0] == ids[1] and ids[0] != ids[2]



# --- LoRA dropout ----------------------------------------------------------------------------
def toygraph_masks(p: float, seed: int = 42):
    """A peft_hook putting toygraph's own dropout masks (ops/stochastic.keep_mask, keyed by
    the seed, the module's GGUF name, the step) into PEFT's lora_dropout modules, so the
    same elements drop on both sides: PEFT's own nn.Dropout draws from torch's RNG."""
    import re
    import zlib
    from toygraph.ops.stochastic.numpy import keep_mask
    step = [0]

    class SameMask(torch.nn.Module):
        def __init__(self, salt):
            super().__init__()
            self.salt = salt

        def forward(self, x):
            keep = keep_mask(x.numel(), p, seed, self.salt, step[0], 0).reshape(x.shape)
            return x * torch.tensor(keep, dtype=x.dtype) * float(np.float32(1 / (1 - p)))

    def hook(model, cfg):
        gguf_by_hf = {hf: g for g, hf in cfg.family.hf_modules.items()}
        n = 0
        for name, module in model.named_modules():
            m = re.search(r"layers\.(\d+)\.(\w+\.\w+)$", name)
            if m and hasattr(module, "lora_dropout"):
                gguf = f"blk.{m.group(1)}.{gguf_by_hf[m.group(2)]}.weight"
                module.lora_dropout["default"] = SameMask(zlib.crc32(gguf.encode()))
                n += 1
        assert n
        return lambda t: step.__setitem__(0, t)
    return hook


def test_dropout_trains_as_peft_with_the_same_masks(tiny_llama, tmp_path):
    """3 steps with p = 0.3 against PEFT given the very masks toygraph drew; the exported
    adapter records lora_dropout and evaluates (no dropout) as PEFT's eval mode does."""
    p = 0.3
    out, mine = check_variant(tiny_llama, tmp_path, lora_dropout=p, peft_hook=toygraph_masks(p))
    import json
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == p
    plain, _, _ = train_both(tiny_llama, tmp_path / "plain", targets=ALL, rank=4, alpha=8,
                             tokens=token_batch(tiny_llama, True, 24), n_prompt=6, steps=STEPS)
    assert all(rel(a, b) > 1e-4 for a, b in zip(mine, plain))   # the masks acted every step


def test_dropout_is_off_in_evaluation_and_each_micro_batch_draws_its_own(tiny_llama):
    from toygraph.core.optimizer import hp_row
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import LoRA, RecipeOptions
    model = GGUFModel(tiny_llama)
    tokens = token_batch(tiny_llama, True, 16)
    B, T = tokens.shape
    labels = np.concatenate([tokens[:, 1:], np.full((B, 1), -1)], 1).astype(np.int32)
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    from test_peft_reference import random_lora, trainable_values
    lora = random_lora(model.config, ("q", "v"), 4, b_std=0.2)

    def recipe_with(p, accum=1):
        r = LoRA(targets=("q", "v"), rank=4, lora_dropout=p)
        r.realize(model, model.config, RecipeOptions(seq_len=T, batch=B, grad_accum=accum))
        r.load_trainable(trainable_values(lora))
        return r

    dropped, plain = recipe_with(0.5), recipe_with(0.0)
    assert dropped.evaluate(tokens, positions, labels) == plain.evaluate(tokens, positions, labels)
    first = dropped.step(tokens[None], positions[None], labels[None], hp_row(1, 0.0), True)
    assert first != plain.step(tokens[None], positions[None], labels[None], hp_row(1, 0.0), True)
    # lr 0: nothing moves, so the same step draws the same loss, another step another
    again = dropped.step(tokens[None], positions[None], labels[None], hp_row(1, 0.0), True)
    other = dropped.step(tokens[None], positions[None], labels[None], hp_row(2, 0.0), True)
    assert again == first and other != first
    # two micro-batches of the same rows: different masks, so the step's loss is not the
    # one-batch loss (it would be with a mask shared by the micro-batches)
    two = recipe_with(0.5, accum=2)
    both = two.step(np.stack([tokens, tokens]), np.stack([positions, positions]),
                    np.stack([labels, labels]), hp_row(1, 0.0), True)
    assert both != first
    assert dropped.evaluate(tokens, positions, labels) == plain.evaluate(tokens, positions, labels)


def test_a_dropout_run_with_accumulation_resumes_exactly(tiny_qwen2, tmp_path):
    from test_run import cfg_for
    from toygraph.training import run_training
    data, straight, resumed = run_and_resume(tiny_qwen2, tmp_path, grad_accum=2,
                                             lora_dropout=0.2, rslora=True)
    assert resumed == straight       # the same masks: bit-exact
    assert (tmp_path / "full" / "adapter.gguf").exists()      # llama.cpp takes it as is
    with pytest.raises(Exception, match="--lora-dropout together with --dora is not supported"):
        run_training(cfg_for(tiny_qwen2, data, tmp_path / "x", lora_dropout=0.1, dora=True))
