"""GRPO's objective (recipes/grpo_loss.py) against TRL's definitions, written out in torch
here from TRL's GRPOTrainer (``_compute_loss`` and the advantages of
``_generate_and_score_completions``): the loss and its gradient for each loss type and
importance-sampling level, with and without the KL term and the old log-probs; f64 finite
differences through the whole objective; the advantages, NaN rewards and degenerate groups."""
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="torch is the reference here: pip install -e '.[reference]'")

from support.gradcheck import check_gradients
from toygraph import ops
from toygraph.core.autodiff import accumulate_grads, backward
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from toygraph.recipes.grpo_loss import LOSS_TYPES, Objective, build_objective, group_advantages

R, C, V = 6, 5, 11            # completions (3 prompts x 2), completion tokens, vocabulary
TEMPERATURE = 0.7


def _case(seed=0):
    """Logits, completion ids, a ragged mask, old and reference log-probs, advantages."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(R, C, V)) * 2
    ids = rng.integers(0, V, size=(R, C))
    lengths = np.array([5, 3, 1, 4, 5, 2])
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.float64)
    lp = torch.log_softmax(torch.tensor(logits) / TEMPERATURE, -1)
    logp = lp.gather(-1, torch.tensor(ids)[..., None])[..., 0].numpy()
    old = (logp + rng.normal(size=(R, C)) * 0.3) * mask     # ratios inside and outside the clip
    ref = (logp + rng.normal(size=(R, C)) * 0.5) * mask
    adv = rng.normal(size=R)
    return logits, ids, mask, old, ref, adv


def trl_loss(logits, ids, mask, old, ref, adv, o: Objective):
    """TRL's GRPOTrainer._compute_loss, its per-token log-probs (logits / temperature) and
    its normalisations, in torch (f64); returns (loss, d loss / d logits)."""
    x = torch.tensor(logits, requires_grad=True)
    logp = torch.log_softmax(x / TEMPERATURE, -1).gather(-1, torch.tensor(ids)[..., None])[..., 0]
    mask = torch.tensor(mask)
    old = logp.detach() if old is None else torch.tensor(old)
    advantages = torch.tensor(adv)[:, None]
    log_ratio = logp - old
    if o.importance_sampling == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - o.epsilon, 1 + o.eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if o.kl_beta != 0.0:
        ref = torch.tensor(ref)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + o.kl_beta * per_token_kl
    if o.loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif o.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif o.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * o.max_completion_length)
    else:  # dapo: num_items_in_batch = the completion tokens of the generation batch
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    return float(loss.detach()), x.grad.numpy()


def _graph(o: Objective, with_old: bool, dtype_f64=True):
    g = Graph()
    x = g.param("logits", np.zeros((R * C, V)))
    labels = g.input("labels", (R * C,), "i32")
    logp = ops.token_logprobs(ops.scale(x, 1.0 / TEMPERATURE), labels).reshape(R, C)
    old = g.input("old", (R, C)) if with_old else logp
    ref = g.input("ref", (R, C)) if o.kl_beta else None
    loss, inputs, _ = build_objective(g, logp, old, ref, o)
    return g, x, labels, old, ref, g.output(loss), inputs


def _upload(sess, case, graph, with_old):
    logits, ids, mask, old_v, ref_v, adv = case
    g, x, labels, old, ref, loss, inputs = graph
    sess.load_param(x, logits.reshape(R * C, V))
    sess.upload(labels, np.where(mask > 0, ids, -1).reshape(-1).astype(np.int32))
    if with_old:
        sess.upload(old, old_v)
    if ref is not None:
        sess.upload(ref, ref_v)
    inputs.upload(sess, mask, adv)


OBJECTIVES = [Objective(loss_type=t, importance_sampling=s, epsilon=0.2, epsilon_high=0.28,
                        kl_beta=b, max_completion_length=C + 3)
              for t in LOSS_TYPES for s in ("token", "sequence") for b in (0.0, 0.04)]


@pytest.mark.parametrize("with_old", [True, False], ids=["old", "detached"])
@pytest.mark.parametrize("o", OBJECTIVES,
                         ids=[f"{o.loss_type}-{o.importance_sampling}-b{o.kl_beta}" for o in OBJECTIVES])
def test_loss_and_gradient_equal_trls(o, with_old):
    case = _case()
    graph = _graph(o, with_old)
    g, x, loss = graph[0], graph[1], graph[5]
    grads = accumulate_grads(backward(loss, [x]))
    sess = Session(g, dtype="f64")
    sess.realize()
    sess.reset()
    _upload(sess, case, graph, with_old)
    sess.run("backward")
    want_loss, want_grad = trl_loss(*case[:3], case[3] if with_old else None, *case[4:], o)
    got_grad = sess.download(grads[x]).reshape(R, C, V)
    assert abs(float(sess.download(loss)) - want_loss) <= 1e-6 * max(1.0, abs(want_loss))
    assert np.abs(got_grad - want_grad).max() <= 1e-6 * np.abs(want_grad).max()
    assert np.abs(want_grad).max() > 0


@pytest.mark.parametrize("o", [OBJECTIVES[1], OBJECTIVES[3], OBJECTIVES[13]],
                         ids=["grpo-token-kl", "grpo-sequence-kl", "dapo-sequence-kl"])
def test_finite_differences_through_the_whole_objective(o):
    case = _case(seed=1)
    g, x, labels, old, ref, loss, inputs = _graph(o, with_old=True)
    logits, ids, mask, old_v, ref_v, adv = case
    from toygraph.recipes.grpo_loss import token_weights
    w = token_weights(mask, o.loss_type, o.max_completion_length)
    feed = {labels: np.where(mask > 0, ids, -1).reshape(-1).astype(np.int32), old: old_v,
            ref: ref_v, inputs.advantages: adv[:, None], inputs.token_weights: w}
    if inputs.sequence_mean is not None:
        feed[inputs.sequence_mean] = mask / mask.sum(1, keepdims=True)
        feed[inputs.sequence_weights] = w.sum(1, keepdims=True)
    x.data = logits.reshape(R * C, V)
    assert check_gradients(g, loss, [x], feed) <= 1e-6


def trl_advantages(rewards, G, scale):
    """TRL's sum_then_normalize advantages (rewards already weighted and summed, NaN where
    every function returned None)."""
    def nanstd(t, dim=None):
        if dim is None:
            var = torch.nanmean((t - torch.nanmean(t, keepdim=True)) ** 2)
            count = torch.sum(~torch.isnan(t))
        else:
            var = torch.nanmean((t - torch.nanmean(t, dim=dim, keepdim=True)) ** 2, dim=dim)
            count = torch.sum(~torch.isnan(t), dim=dim)
        return torch.sqrt(var * count / (count - 1))
    r = torch.tensor(rewards)
    mean = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G)
    std = (nanstd(r.view(-1, G), dim=1).repeat_interleave(G) if scale in ("group", "none")
           else nanstd(r).expand_as(r))
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0).numpy()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_and_degenerate_groups_get_zero(scale):
    rewards = np.array([1.0, 0.0, 0.5, 1.0,      # a mixed group
                        0.5, 0.5, 0.5, 0.5,      # degenerate
                        2.0, np.nan, 0.0, 1.0,   # one completion no function scored
                        3.0, 3.0, np.nan, 3.0])  # degenerate, with a NaN
    adv, degenerate = group_advantages(rewards, 4, scale)
    np.testing.assert_allclose(adv, trl_advantages(rewards, 4, scale), rtol=1e-12, atol=1e-15)
    assert degenerate.tolist() == [False, True, False, True]
    assert np.all(adv[4:8] == 0) and adv[9] == 0 and np.all(adv[12:] == 0)
