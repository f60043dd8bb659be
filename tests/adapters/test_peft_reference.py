"""PEFT adapters written by toygraph are what PyTorch + PEFT expect, and LoRA training
steps match PyTorch + PEFT + torch.optim.AdamW from the same init, data and settings.

Both sides load the same GGUF (transformers dequantizes it to float32, un-permuting llama
Q/K rows); the adapter crosses the boundary as a PEFT directory written by save_peft, so
these tests also check its q/k row conversion."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from toygraph.adapters.files import save_peft  # noqa: E402
from toygraph.models.model import GGUFModel  # noqa: E402
from toygraph.inference.language_model import LanguageModel  # noqa: E402
from toygraph.models.decoder import ALL_TARGETS, TARGETS, lora_shapes  # noqa: E402
from toygraph.core.optimizer import hp_row  # noqa: E402
from toygraph.recipes import LoRA, RecipeOptions  # noqa: E402

pytestmark = pytest.mark.reference
ALL = tuple(TARGETS)
TEXTS = ["The capital of France is Paris. It is known for the Eiffel Tower and the Louvre",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5, of course it does"]


def random_lora(cfg, targets, rank, seed=0, b_std=0.02, present=None):
    """Non-zero A and B: A ~ N(0, 1/n_in) keeps x A^T at unit scale, B sets the effect.
    ``present`` (the file's tensor names) skips projections a layer lacks (Gemma 4)."""
    rng = np.random.default_rng(seed)
    lora = {}
    for i in range(cfg.n_layer):
        for t in targets:
            name = f"blk.{i}.{ALL_TARGETS[t]}.weight"
            if present is not None and name.replace("gate_up", "gate") not in present:
                continue
            a_shape, b_shape = lora_shapes(cfg, name, rank)   # expert stacks: [E, ...] each
            lora[name] = ((rng.normal(size=a_shape) / np.sqrt(a_shape[-1])).astype(np.float32),
                          (rng.normal(size=b_shape) * b_std).astype(np.float32))
    return lora


def trainable_values(lora: dict) -> dict:
    """The LoRA recipe's trainable tensors by name from {weight: (A, B) or (A, B, m)}."""
    out = {}
    for n, (a, b, *m) in lora.items():
        out.update({f"{n}.lora_a": a, f"{n}.lora_b": b})
        if m:
            out[f"{n}.lora_magnitude"] = m[0]
    return out


def gguf_reference(path):
    """transformers' own model of a GGUF (float32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)


def peft_model(path, adapter_dir, trainable=False, reference=gguf_reference):
    """PEFT's LoRA model: the adapter directory on ``reference(path)``."""
    return peft.PeftModel.from_pretrained(reference(path), str(adapter_dir), is_trainable=trainable)


def token_batch(path, tiny: bool, seq: int):
    if tiny:
        vocab = GGUFModel(path).config.n_vocab
        return np.random.default_rng(0).integers(0, vocab, size=(2, seq)).astype(np.int32)
    from toygraph.gguf.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    return np.array([tok.encode(t)[:seq] for t in TEXTS], np.int32)


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2",
                                   pytest.param("smollm2", marks=pytest.mark.slow)])
def test_peft_adapter_loss_matches_transformers(which, request, tmp_path):
    path = request.getfixturevalue(which)
    cfg = GGUFModel(path).config
    rank = 4
    b_std = 0.05 if which == "smollm2" else 0.2  # tiny weights are small: a visible effect
    save_peft(tmp_path, random_lora(cfg, ALL, rank, b_std=b_std), cfg, rank=rank,
              alpha=2 * rank, targets=ALL)
    tokens = token_batch(path, which != "smollm2", 16)

    mine, n = LanguageModel(path, adapter_dir=tmp_path).loss(tokens.tolist())
    base, _ = LanguageModel(path).loss(tokens.tolist())
    model = peft_model(path, tmp_path)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.double()
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)).item()
    print(f"{which}: base {base:.7f} adapter: toygraph {mine:.7f} peft {ref:.7f} "
          f"rel {rel(mine, ref):.2e}")
    assert n == tokens.shape[0] * (tokens.shape[1] - 1)
    assert rel(mine, ref) <= 1e-4
    assert abs(mine - base) > 100 * 1e-4 * ref  # the adapter matters far beyond tolerance


def train_both(path, tmp_path, *, targets, rank, alpha, tokens, n_prompt, steps=5, lr=2e-3,
               betas=(0.9, 0.99), eps=1e-8, wd=0.05, max_norm=0.5, reference=gguf_reference,
               keep=None, peft_hook=None, **variants):
    """Per-step losses of toygraph's LoRA recipe and of torch + PEFT (on the model
    ``reference(path)``) from the same init. ``variants``: the LoRA recipe's rslora, dora,
    lora_plus_ratio (LoRA+: PEFT's create_loraplus_optimizer). ``keep`` (a dict) receives the
    recipe, the PEFT model, the labels. ``peft_hook(model, cfg)`` may adjust the PEFT model
    and return a function called with each step's number before its forward."""
    model_file = GGUFModel(path)
    cfg = model_file.config
    lora = random_lora(cfg, targets, rank, present=model_file.tensor_names())
    B, T = tokens.shape
    labels = np.concatenate([tokens[:, 1:], np.full((B, 1), -1)], 1).astype(np.int32)
    labels[:, :n_prompt] = -1  # prompt positions are not trained on

    recipe = LoRA(targets=targets, rank=rank, alpha=alpha, **variants)
    recipe.realize(model_file, cfg, RecipeOptions(seq_len=T, batch=B, clip=max_norm))
    if variants.get("dora"):   # magnitudes moved off their init (the row norms of W)
        rng = np.random.default_rng(1)
        start = recipe.trainable()
        lora = {n: (a, b, (start[f"{n}.lora_magnitude"] * (1 + 0.2 * rng.normal(size=b.shape[0])))
                    .astype(np.float32)) for n, (a, b) in lora.items()}
    recipe.load_trainable(trainable_values(lora))
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    mine, norms = [], []
    for t in range(1, steps + 1):
        mine.append(recipe.step(tokens[None], positions[None], labels[None], hp_row(t, lr, *betas, eps, wd),
                                is_first=(t == 1)))
        norms.append(recipe.last_grad_norm())

    save_peft(tmp_path, lora, cfg, rank=rank, alpha=alpha, targets=targets,
              rslora=variants.get("rslora", False))
    model = peft_model(path, tmp_path, trainable=True, reference=reference)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == sum(len(pair) for pair in lora.values())
    before_step = peft_hook(model, cfg) if peft_hook else (lambda t: None)
    if variants.get("lora_plus_ratio", 1.0) != 1.0:   # PEFT's weight decay for LoRA+ is its own kwarg
        from peft.optimizers import create_loraplus_optimizer
        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=lr,
                                        loraplus_lr_ratio=variants["lora_plus_ratio"], betas=betas,
                                        eps=eps, loraplus_weight_decay=wd)
    else:
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    ids = torch.tensor(tokens, dtype=torch.long)
    target = torch.tensor(np.where(labels < 0, -100, labels), dtype=torch.long).reshape(-1)
    ref = []
    for t in range(1, steps + 1):
        before_step(t)
        opt.zero_grad()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target,
                                                 ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        ref.append(loss.item())
    if keep is not None:
        keep.update(recipe=recipe, model=model, labels=labels, cfg=cfg)
    return mine, ref, norms


def _report_and_check(what, mine, ref, norms, max_norm):
    errs = [rel(a, b) for a, b in zip(mine, ref)]
    print(f"{what}: toygraph {np.round(mine, 6).tolist()}\n  torch {np.round(ref, 6).tolist()}\n"
          f"  grad norms {np.round(norms, 4).tolist()} max rel {max(errs):.2e}")
    assert max(errs) <= 1e-4
    assert any(n > max_norm for n in norms)   # clipping was exercised
    assert abs(mine[-1] - mine[0]) > 1e-3     # and the steps actually trained


def test_lora_training_matches_peft_tiny_llama(tiny_llama, tmp_path):
    tokens = token_batch(tiny_llama, True, 24)
    mine, ref, norms = train_both(tiny_llama, tmp_path, targets=ALL, rank=4, alpha=8,
                                  tokens=tokens, n_prompt=6)
    _report_and_check("tiny_llama", mine, ref, norms, 0.5)


@pytest.mark.slow
def test_lora_training_matches_peft_smollm2(smollm2, tmp_path):
    tokens = token_batch(smollm2, False, 16)
    # A gentler rate than tiny's: at 2e-3 two short texts are memorised within 5 steps
    # (loss -> 0.05), where a fixed f32 rounding gap becomes a large *relative* one.
    mine, ref, norms = train_both(smollm2, tmp_path, targets=("q", "v"), rank=8, alpha=16,
                                  tokens=tokens, n_prompt=4, lr=3e-4)
    _report_and_check("SmolLM2", mine, ref, norms, 0.5)
