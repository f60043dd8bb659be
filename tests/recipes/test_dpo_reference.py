"""DPO and ORPO steps equal a direct torch + PEFT implementation of the same losses.

Both sides load the same tiny GGUF (transformers dequantizes it) and start from the same
LoRA adapter (crossing the boundary as a PEFT directory). The torch side writes the
formulas out as TRL implements them (DPOTrainer's sigmoid loss with label smoothing and
its rewards; ORPOTrainer's odds-ratio loss on mean per-token log-probs plus the chosen
NLL): TRL itself is not a dependency. Three optimizer steps on three different batches,
the last one holding a padding pair; the loss and every metric agree within 1e-4
relative or 1e-5 absolute, whichever is larger (see check)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_peft_reference import peft_model, random_lora  # noqa: E402
from toygraph.adapters.files import save_peft  # noqa: E402
from toygraph.models.model import GGUFModel  # noqa: E402
from toygraph.core.optimizer import hp_row  # noqa: E402
from toygraph.recipes import DPO, ORPO, RecipeOptions  # noqa: E402

F = torch.nn.functional
pytestmark = pytest.mark.reference
TARGETS, RANK, ALPHA = ("q", "v", "down"), 4, 8
B, T, STEPS, LR, CLIP = 2, 16, 3, 1e-2, 1.0


def pair_batch(rng, vocab, padding_pair: bool):
    """tokens and labels [2B, T]: chosen rows then rejected; each row's labels are its
    next tokens over a response span after a prompt (chosen and rejected share the
    prompt), -1 elsewhere; ``padding_pair`` makes the last pair all-ignored."""
    tokens = rng.integers(0, vocab, size=(2 * B, T)).astype(np.int32)
    labels = np.full((2 * B, T), -1, np.int32)
    for i in range(B):
        n_prompt = int(rng.integers(3, 7))
        tokens[B + i, :n_prompt] = tokens[i, :n_prompt]
        for row in (i, B + i):
            end = int(rng.integers(n_prompt + 2, T))
            labels[row, n_prompt - 1:end] = tokens[row, n_prompt:end + 1]
    if padding_pair:
        labels[[B - 1, 2 * B - 1]] = -1
    return tokens, labels


def run_toygraph(recipe, path, lora, batches, **load):
    m = GGUFModel(path)
    recipe.realize(m, m.config, RecipeOptions(seq_len=T, batch=B, clip=CLIP))
    values = {f"{n}.{h}": x for n, (a, b) in lora.items() for h, x in (("lora_a", a), ("lora_b", b))}
    (recipe.load_adapter_init if load.get("adapter_init") else recipe.load_trainable)(values)
    positions = np.tile(np.arange(T, dtype=np.int32), (1, 2 * B, 1))
    out = []
    for t, (tokens, labels) in enumerate(batches, start=1):
        recipe.step(tokens[None], positions, labels[None], hp_row(t, LR), is_first=(t == 1))
        out.append(dict(recipe.last_metrics))
    return out


def sequence_logps(model, tokens, labels):
    """Per row: summed log-probs of the labels, and the number of labels."""
    logits = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits
    lab = torch.tensor(labels, dtype=torch.long)
    mask = lab >= 0
    lp = torch.gather(logits.log_softmax(-1), 2, lab.clamp(min=0)[..., None])[..., 0]
    return (lp * mask).sum(-1), mask.sum(-1), logits


def run_torch(path, tmp_path, lora, batches, loss_fn):
    """loss_fn(model, tokens, labels, keep) -> (loss, metrics) over the pairs ``keep``."""
    cfg = GGUFModel(path).config
    save_peft(tmp_path, lora, cfg, rank=RANK, alpha=ALPHA, targets=TARGETS)
    model = peft_model(path, tmp_path, trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = []
    for tokens, labels in batches:
        keep = [i for i in range(B) if (labels[i] >= 0).any()]
        rows = keep + [B + i for i in keep]
        opt.zero_grad()
        loss, metrics = loss_fn(model, tokens[rows], labels[rows], len(keep))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        out.append({"loss": loss.item(), **metrics})
    return out


def reward_metrics(chosen, rejected):
    chosen, rejected = chosen.detach(), rejected.detach()
    return {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
            "rewards/margin": (chosen - rejected).mean().item(),
            "rewards/accuracy": (chosen > rejected).float().mean().item()}


def dpo_loss(beta, ls, reference):
    """TRL's sigmoid DPO loss; ``reference(tokens, labels)`` gives the reference logps."""
    def loss_fn(model, tokens, labels, n):
        pi, _, _ = sequence_logps(model, tokens, labels)
        with torch.no_grad():
            ref = reference(model, tokens, labels)
        l = (pi[:n] - pi[n:]) - (ref[:n] - ref[n:])
        losses = -F.logsigmoid(beta * l) * (1 - ls) - F.logsigmoid(-beta * l) * ls
        return losses.mean(), reward_metrics(beta * (pi[:n] - ref[:n]), beta * (pi[n:] - ref[n:]))
    return loss_fn


def orpo_loss(beta):
    """TRL's ORPO loss: chosen NLL (mean over tokens) - beta * mean logsigmoid(log odds)."""
    def loss_fn(model, tokens, labels, n):
        total, count, logits = sequence_logps(model, tokens, labels)
        avg = total / count
        lc, lr = avg[:n], avg[n:]
        nll = F.cross_entropy(logits[:n].reshape(-1, logits.shape[-1]),
                              torch.tensor(labels[:n], dtype=torch.long).reshape(-1), ignore_index=-1)
        log_odds = (lc - lr) - (torch.log1p(-torch.exp(lc)) - torch.log1p(-torch.exp(lr)))
        ratio = F.logsigmoid(log_odds)
        metrics = reward_metrics(beta * lc, beta * lr)
        metrics.update({"nll": nll.item(), "log_odds_ratio": ratio.mean().item(),
                        "log_odds_chosen": log_odds.mean().item()})
        return nll - (beta * ratio).mean(), metrics
    return loss_fn


def check(mine, ref):
    """Relative 1e-4, with an absolute floor of 1e-5: a reward is beta times a difference of
    sequences' summed log-probs (tens of nats, f32 rounding ~1e-6 each), so a small margin
    carries their rounding, not its own."""
    for t, (a, b) in enumerate(zip(mine, ref), start=1):
        print(f"step {t}: " + ", ".join(f"{k} {a[k]:.6g}/{b[k]:.6g}" for k in b))
        for k in b:
            assert abs(a[k] - b[k]) <= max(1e-4 * abs(b[k]), 1e-5), (t, k, a[k], b[k])
    assert abs(mine[-1]["loss"] - mine[0]["loss"]) > 1e-3  # the steps trained


def batches_for(path, seed=0):
    rng = np.random.default_rng(seed)
    vocab = GGUFModel(path).config.n_vocab
    return [pair_batch(rng, vocab, padding_pair=(t == STEPS - 1)) for t in range(STEPS)]


@pytest.mark.parametrize("beta,ls", [(0.5, 0.0), (2.0, 0.2)])
def test_dpo_steps_match_torch_with_the_base_as_reference(tiny_llama, tmp_path, beta, ls):
    """Policy = base + a non-zero adapter; reference = base (the adapter switched off)."""
    cfg = GGUFModel(tiny_llama).config
    lora = random_lora(cfg, TARGETS, RANK, b_std=0.2)
    batches = batches_for(tiny_llama)
    mine = run_toygraph(DPO(TARGETS, RANK, ALPHA, beta=beta, label_smoothing=ls), tiny_llama,
                        lora, batches)

    def base(model, tokens, labels):
        with model.disable_adapter():
            return sequence_logps(model, tokens, labels)[0]
    ref = run_torch(tiny_llama, tmp_path, lora, batches, dpo_loss(beta, ls, base))
    check(mine, ref)
    assert mine[0]["rewards/margin"] != 0  # the reference really is the base


def test_dpo_from_an_adapter_init_uses_it_frozen_as_reference(tiny_llama, tmp_path):
    """--adapter-init: reference = base + the initial adapter, which never moves."""
    cfg = GGUFModel(tiny_llama).config
    lora = random_lora(cfg, TARGETS, RANK, b_std=0.2)
    batches = batches_for(tiny_llama, seed=1)
    mine = run_toygraph(DPO(TARGETS, RANK, ALPHA, beta=0.5, reference_adapter=True),
                        tiny_llama, lora, batches, adapter_init=True)
    save_peft(tmp_path / "init", lora, cfg, rank=RANK, alpha=ALPHA, targets=TARGETS)
    frozen = peft_model(tiny_llama, tmp_path / "init")

    def initial(model, tokens, labels):
        return sequence_logps(frozen, tokens, labels)[0]
    ref = run_torch(tiny_llama, tmp_path / "run", lora, batches, dpo_loss(0.5, 0.0, initial))
    assert mine[0]["rewards/margin"] == 0 and abs(mine[0]["loss"] - np.log(2)) < 1e-6
    check(mine, ref)


def test_orpo_steps_match_torch(tiny_llama, tmp_path):
    cfg = GGUFModel(tiny_llama).config
    lora = random_lora(cfg, TARGETS, RANK, b_std=0.2)
    batches = batches_for(tiny_llama, seed=2)
    mine = run_toygraph(ORPO(TARGETS, RANK, ALPHA, beta=0.3), tiny_llama, lora, batches)
    ref = run_torch(tiny_llama, tmp_path, lora, batches, orpo_loss(0.3))
    check(mine, ref)
