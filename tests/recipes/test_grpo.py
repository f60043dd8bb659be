"""The GRPO recipe (recipes/grpo.py) on a tiny model: the sampler reads the adapter being
trained (the same tensors, no copy), the completion log-probs are the model's, a seed
reproduces the run, resume continues bit for bit (mid-rollout too), rewards that break
their contract stop the run on one line, and (slow) the mean reward rises."""
import dataclasses
import json
import shutil

import numpy as np
import pytest

from toygraph.core.optimizer import hp_row
from toygraph.errors import ToygraphError
from toygraph.inference.batched import BatchedGenerator
from toygraph.inference.language_model import LanguageModel
from toygraph.inference.sampling import SamplingOptions
from toygraph.models.model import GGUFModel
from toygraph.recipes import GRPO, RecipeOptions
from toygraph.recipes.grpo_loss import Objective, token_weights
from toygraph.training import RunConfig, run_training

WORDS = "abcdefghijklmnop"


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path)


def write_prompts(folder):
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the cat sat on the mat {w}" + " and" * (i % 3),
                                        "answer": w}) + "\n" for i, w in enumerate(WORDS)))
    return path


def cfg(model, data, out, **kw):
    base = dict(model=str(model), data=str(data), out=str(out), recipe="grpo",
                reward=("regex:[0-9]",), steps=4, batch=2, num_generations=4, seq_len=16,
                max_completion_length=6, val_split=0, lr=2e-2, quiet=True, seed=3)
    base.update(kw)
    return RunConfig(**base)


def steps(out):
    return [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
            if e["event"] == "step"]


def _recipe(model_path, data, rewards=("regex:[0-9]",), **kw):
    """A realized GRPO recipe with the prompts of ``data`` known to it."""
    from toygraph.data.prompts import encode_prompts, load_prompts
    model = GGUFModel(model_path)
    recipe = GRPO(rewards=list(rewards), num_generations=4, max_completion_length=6, **kw)
    opts = RecipeOptions(seq_len=16, batch=2, seed=3, init_scale=0.3)
    recipe.realize(model, model.config, opts)
    items = encode_prompts(load_prompts(data), recipe.tok, 16).items
    recipe.make_batches(items, 2, 16, recipe.pad, shuffle=False, seed=0, epoch=0)
    return recipe, model, items


def test_the_sampler_shares_the_trained_tensors(tiny_llama, prompts):
    check_the_sampler_shares_the_trained_tensors(tiny_llama, prompts)


def test_the_sampler_on_gpt_oss(prompts):
    """Sinks, sliding windows, MoE layers (the other families: test_gemma4.py, test_qwen35.py)."""
    from support.moe_references import gguf_path
    check_the_sampler_shares_the_trained_tensors(gguf_path("gpt-oss"), prompts)


def check_the_sampler_shares_the_trained_tensors(tiny_llama, prompts, rewards=("regex:[0-9]",)):
    """``rewards`` must vary within some group (else no update moves the adapter)."""
    recipe, model, items = _recipe(tiny_llama, prompts, rewards,
                                   objective=Objective(max_completion_length=6))
    gen = recipe.gen
    assert gen.prefill.weights is recipe.net.weights
    assert all(gen.prefill.lora[k] == recipe.net.lora[k] for k in recipe.net.lora)
    assert all(a is x and b is y for (a, b), (x, y) in
               zip(gen.prefill.lora.values(), recipe.net.lora.values()))
    # Train a few steps with a large rate, then sample greedily in the recipe's graph and
    # with a standalone generator loaded with the adapter's current values: same tokens.
    batch = recipe.make_batches(items, 2, 16, recipe.pad, shuffle=True, seed=0, epoch=0)[0]
    for t in range(1, 4):
        recipe.step(batch.tokens[None], batch.positions[None], batch.labels[None],
                    hp_row(t, 0.05), is_first=t == 1)
    values = recipe.trainable()
    adapter = {k: (values[a.name], values[b.name]) for k, (a, b) in recipe.net.lora.items()}
    assert any(np.abs(b).max() > 0 for _, b in adapter.values())
    ids = batch.labels[:, 0]
    rollout = recipe.make_rollout(ids, None, SamplingOptions())
    lm = LanguageModel(tiny_llama)
    lm.lora_config, lm.adapter = recipe.lora_config(recipe.opts), adapter
    standalone = BatchedGenerator(model, rows=recipe.rows, prompt_len=16, cache_len=22,
                                  lora=lm.lora_config, adapter=adapter)
    group = [recipe.prompts[int(i)].tokens for i in ids for _ in range(4)]
    want = standalone.generate(group, 6, stop_ids=recipe.stop_ids)
    labels = rollout["labels"].reshape(recipe.rows, -1)
    assert [list(l[l >= 0]) for l in labels] == want
    # the rollout ran the prefill over one row per prompt, the standalone one over all
    assert [p.rows for p in gen.passes] == [2, recipe.rows]
    assert {key for _, key in gen.programs} == {2, 0}


def test_completion_logprobs_are_the_models(tiny_llama, prompts):
    """The log-probs the objective sees (get_rows of the completion positions, logits /
    temperature) against the model's full-window logits at those positions."""
    recipe, model, items = _recipe(tiny_llama, prompts, temperature=0.8)
    ids = np.array([0, 5])
    rollout = recipe.make_rollout(ids, np.random.default_rng(0))
    recipe.upload_rollout(rollout)
    recipe.sess.run_program(recipe.sess.program([recipe.logp]))
    got = recipe.sess.download(recipe.logp)
    lm = LanguageModel(tiny_llama)
    T = 22
    f = lm._forward(recipe.rows, T)
    lm._run(f, rollout["tokens"], np.full((recipe.rows, T), -1, np.int32))
    logits = f.sess.download(f.logits).reshape(recipe.rows, T, -1).astype(np.float64) / 0.8
    labels = rollout["labels"].reshape(recipe.rows, -1)
    for r in range(recipe.rows):
        n = len(recipe.prompts[int(ids[r // 4])].tokens)
        for j in np.nonzero(labels[r] >= 0)[0]:
            z = logits[r, n - 1 + j]
            want = z[labels[r, j]] - z.max() - np.log(np.exp(z - z.max()).sum())
            assert abs(got[r, j] - want) < 1e-4
        assert np.all(got[r][labels[r] < 0] == 0)


def test_the_step_loss_is_the_objective_of_its_rollout(tiny_llama, prompts):
    """One update per rollout: ratio 1, so the dapo loss is -sum(A * mask) / tokens."""
    recipe, model, items = _recipe(tiny_llama, prompts, objective=Objective(max_completion_length=6))
    batch = recipe.make_batches(items, 2, 16, recipe.pad, shuffle=True, seed=0, epoch=0)[0]
    loss = recipe.step(batch.tokens[None], batch.positions[None], batch.labels[None],
                       hp_row(1, 1e-3), is_first=True)
    r = recipe.rollout
    mask = r["labels"].reshape(recipe.rows, -1) >= 0
    want = -(token_weights(mask, "dapo", 6) * r["advantages"][:, None]).sum()
    assert loss == pytest.approx(want, abs=1e-6)
    m = recipe.last_metrics
    assert m["completions/mean_length"] == mask.sum(1).mean() and m["clip_ratio"] == 0.0


@pytest.mark.parametrize("kw", [{}, dict(num_iterations=2, kl_beta=0.05,
                                         importance_sampling="sequence", loss_type="grpo")],
                         ids=["plain", "mu2-kl-gspo"])
def test_a_seed_repeats_the_run_and_resume_continues_it_exactly(tiny_llama, prompts, tmp_path, kw):
    """5 steps straight == resumed from the step-3 checkpoint (with mu = 2 that is inside a
    rollout: step 4 reuses step 3's), bit for bit; the same seed repeats the run."""
    run_training(cfg(tiny_llama, prompts, tmp_path / "a", steps=5, save_every=3, **kw))
    run_training(cfg(tiny_llama, prompts, tmp_path / "b", steps=5, **kw))
    straight = steps(tmp_path / "a")
    same = ("loss", "reward", "grad_norm", "completions/mean_length")
    assert [[e[k] for k in same] for e in straight] == [[e[k] for k in same] for e in steps(tmp_path / "b")]
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "a", part)
    shutil.rmtree(part / "checkpoints" / "step-000005")
    run_training(cfg(tiny_llama, prompts, part, steps=5, save_every=3,
                     resume=str(part / "checkpoints" / "step-000003"), **kw))
    resumed = steps(part)[-2:]
    assert [e["step"] for e in resumed] == [4, 5]
    assert [[e[k] for k in same] for e in resumed] == [[e[k] for k in same] for e in straight[3:]]
    for name in ("adapter_model.safetensors",):
        assert (part / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    if kw:
        assert straight[3]["time/generation_s"] == 0.0 and "kl" in straight[3]


def test_a_validation_split_scores_greedy_completions(tiny_llama, prompts, tmp_path):
    run_training(cfg(tiny_llama, prompts, tmp_path / "v", val_split=0.25, steps=2,
                     reward=("regex:[0-9]", "length:0:3"), reward_weights=("1", "0.5")))
    evals = [e for e in map(json.loads, (tmp_path / "v" / "events.jsonl").read_text().splitlines())
             if e["event"] == "eval"]
    assert [e["prompts"] for e in evals] == [4, 4]
    e = evals[0]
    want = e["val_rewards/regex:[0-9]/mean"] + 0.5 * e["val_rewards/length:0:3/mean"]
    assert e["val_loss"] == pytest.approx(-want) and e["val_reward"] == pytest.approx(want)


def test_a_reward_that_breaks_its_contract_stops_the_run_on_one_line(tiny_llama, prompts, tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def short(prompts, completions, **kw):\n    return [1.0]\n"
                      "def boom(prompts, completions, answer, **kw):\n"
                      "    raise ValueError('no\\nanswer')\n")
    for name, needle in (("short", "reward {}:short returned 1 values for 8 completions"),
                         ("boom", "reward {}:boom failed: ValueError: no answer")):
        spec = f"{module}:{name}"
        with pytest.raises(ToygraphError, match=needle.format(module).replace("[", r"\[")) as e:
            run_training(cfg(tiny_llama, prompts, tmp_path / name, reward=(spec,)))
        assert "\n" not in str(e.value)
        end = json.loads((tmp_path / name / "events.jsonl").read_text().splitlines()[-1])
        assert end["event"] == "run_end" and end["status"] == "failed"


def test_options_it_cannot_honour_are_refused(tiny_llama, prompts, tmp_path):
    for kw, needle in ((dict(grad_accum=2), "takes one micro-batch per step"),
                       (dict(max_completion_length=2000), "exceed the model's context length"),
                       (dict(reward=()), "GRPO needs at least one --reward"),
                       (dict(reward=("nope",)), "--reward 'nope': not a reward"),
                       (dict(recipe="lora", reward=(), num_generations=5), "--num-generations is for --recipe grpo")):
        with pytest.raises(ToygraphError, match=needle):
            run_training(cfg(tiny_llama, prompts, tmp_path / "x", overwrite=True, **kw))


def test_the_command_line_repeats_reward(tmp_path):
    from toygraph.cli.finetune import run_config_from_args
    from toygraph.cli.main import build_parser
    (tmp_path / "m.gguf").write_bytes(b"")
    args = build_parser().parse_args(
        ["finetune", "--model", str(tmp_path / "m.gguf"), "--data", "d", "--out", "o",
         "--recipe", "grpo", "--reward", "json", "--reward", "regex:^a{1,3}$",
         "--reward-weights", "1,0.5", "--loss-type", "bnpo", "--kl-beta", "0.01"])
    c = run_config_from_args(args)
    assert c.reward == ("json", "regex:^a{1,3}$") and c.reward_weights == ("1", "0.5")
    assert (c.loss_type, c.kl_beta) == ("bnpo", 0.01)


@pytest.mark.slow
def test_the_mean_reward_rises(tiny_llama, prompts, tmp_path):
    """Reward: the completion holds a digit. 30 steps of 4 prompts x 8 completions."""
    run_training(cfg(tiny_llama, prompts, tmp_path / "r", steps=30, batch=4, num_generations=8,
                     schedule="constant"))
    rewards = [e["reward"] for e in steps(tmp_path / "r")]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.25, rewards


def test_the_cuda_graphs_and_activation_checkpointing_take_the_same_steps(
        tiny_llama, prompts, tmp_path, monkeypatch):
    """The same run on the CUDA kernels (host executor: the fused head, the captured
    programs) and with each training block recomputed in the backward."""
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    runs = {}
    for name, kw in (("cpu", {}), ("cuda", dict(backend="cuda")),
                     ("ckpt", dict(checkpoint_activations=True))):
        run_training(cfg(tiny_llama, prompts, tmp_path / name, steps=3, kl_beta=0.02, **kw))
        runs[name] = steps(tmp_path / name)
    keys = ("loss", "kl", "grad_norm")
    assert [[e[k] for k in keys] for e in runs["ckpt"]] == [[e[k] for k in keys] for e in runs["cpu"]]
    for a, b in zip(runs["cuda"], runs["cpu"]):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7)
    assert runs["cpu"][-1]["kl"] > 0


def test_a_reward_that_exits_or_forks_fails_the_run_on_one_line(tiny_llama, prompts, tmp_path):
    """sys.exit(0) in a reward ended the run with exit 0 and no run_end; os.fork() made
    copies of the run that pruned each other's checkpoints (issue 39)."""
    import subprocess
    import sys
    module = tmp_path / "bad_rewards.py"
    module.write_text("import os, sys\n"
                      "def exits(prompts, completions, **kw):\n    sys.exit(0)\n"
                      "def forks(prompts, completions, **kw):\n"
                      "    os.fork()\n    return [1.0] * len(completions)\n")
    for name, needle in (("exits", "called sys.exit(0)"), ("forks", "called os.fork()")):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "toygraph.cli", "finetune", "--model",
                               str(tiny_llama), "--data", str(prompts), "--out", str(out),
                               "--recipe", "grpo", "--reward", f"{module}:{name}", "--steps", "2",
                               "--batch", "2", "--num-generations", "4", "--seq-len", "16",
                               "--max-completion-length", "6", "--val-split", "0", "--quiet"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        runs = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]
        assert [e["event"] for e in runs].count("run_start") == 1
        assert runs[-1]["event"] == "run_end" and runs[-1]["status"] == "failed"
        assert needle in runs[-1]["reason"]


def test_a_second_ctrl_c_stops_a_hung_reward_at_once(tiny_llama, prompts, tmp_path):
    """A hung reward ran until SIGKILL: the second Ctrl-C now stops the run at once (the
    reward's process with it), the first one waits for the step as always."""
    import os
    import signal
    import threading
    import time
    module, called = tmp_path / "slow.py", tmp_path / "called"
    module.write_text(f"import pathlib, time\ndef hangs(prompts, completions, **kw):\n"
                      f"    pathlib.Path({str(called)!r}).touch()\n    time.sleep(120)\n")
    pid, done = os.getpid(), threading.Event()

    def ctrl_c_twice_in_the_reward():
        while not called.exists() and not done.wait(0.05):
            pass
        if not done.is_set():
            os.kill(pid, signal.SIGINT)
            time.sleep(0.5)
            os.kill(pid, signal.SIGINT)
    sender = threading.Thread(target=ctrl_c_twice_in_the_reward)
    sender.start()
    try:
        s = run_training(cfg(tiny_llama, prompts, tmp_path / "r", reward=(f"{module}:hangs",),
                             steps=2))
    finally:
        done.set()
        sender.join()
    t0 = called.stat().st_mtime
    assert time.time() - t0 < 30   # not the reward's 120 s
    assert s["status"] == "interrupted"
    assert s["reason"] == "SIGINT twice: aborted during step 1, no checkpoint written for it"


def test_a_mix_of_prompt_files_keeps_every_prompt_its_own_id(tiny_llama, tmp_path):
    """Each file numbers its prompts from 0, and that number is the prompt's id in GRPO's
    batches (the labels' column 0); in a mix the second file's ids are offset, so no
    rollout is scored against another file's row."""
    from toygraph.training.prepare import prepare
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"cat {w}", "answer": f"a{i}"}) + "\n"
                         for i, w in enumerate(WORDS[:5])))
    b.write_text("".join(json.dumps({"prompt": f"mat {w}", "answer": f"b{i}"}) + "\n"
                         for i, w in enumerate(WORDS[:3])))
    prep = prepare(dataclasses.replace(cfg(tiny_llama, a, tmp_path / "run"), data=(str(a), str(b))))
    answer_of = {}
    for item in prep.train:
        assert answer_of.setdefault(item.index, item.row.fields["answer"]) == item.row.fields["answer"]
    assert sorted(answer_of.values()) == ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2"]
    recipe = GRPO(rewards=["regex:[0-9]"], num_generations=4, max_completion_length=6)
    recipe.make_batches(prep.train, 2, 16, prep.pad, shuffle=False, seed=0, epoch=0)
    assert {i: p.row.fields["answer"] for i, p in recipe.prompts.items()} == answer_of


def test_a_run_that_fails_to_build_leaves_no_directory_it_made(tiny_llama, prompts, tmp_path):
    """A reward file without the named function is found when the recipe is built, after
    the run directory was made: the failed run takes away the folder it created, and
    leaves a folder it did not create as it found it."""
    reward = tmp_path / "reward.py"
    reward.write_text("def other(completions, **kw):\n    return [0.0 for _ in completions]\n")
    out = tmp_path / "runs" / "new"
    with pytest.raises(ToygraphError, match="missing"):
        run_training(cfg(tiny_llama, prompts, out, reward=(f"{reward}:missing",)))
    assert not out.exists() and out.parent.is_dir()
    out.mkdir()
    with pytest.raises(ToygraphError, match="missing"):
        run_training(cfg(tiny_llama, prompts, out, reward=(f"{reward}:missing",)))
    assert out.is_dir() and not any(out.iterdir())
