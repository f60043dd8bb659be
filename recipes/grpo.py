"""GRPO: reinforcement learning from reward functions, with LoRA on the GGUF and our own
batched sampling, in one realized graph.

>>> recipe = GRPO(rewards=["json", "exact:capital"], num_generations=8)        # doctest: +SKIP
>>> recipe.realize(model, model.config, RecipeOptions(seq_len=64, batch=4))     # doctest: +SKIP

Each step takes ``batch`` prompts (a prompt batch, toygraph/data/prompts.py), samples
``num_generations`` completions of each (temperature, top-p, at most
``max_completion_length`` tokens, stopping at an end-of-turn token), scores them with the
reward functions (recipes/rewards.py), turns the rewards into group-relative advantages
and takes one optimizer step on the objective (recipes/grpo_loss.py, TRL's semantics).

One graph holds it all: the training decoder over rows of ``seq_len + max_completion_length``
tokens (the prompt, its completion, padding), the reference pass (adapter off, as DPO's)
when ``kl_beta`` > 0, and the batched prefill + decode graphs of the sampler
(toygraph/inference/batched.py) built over the training decoder's own weight and adapter
tensors, so the completions come from the adapter as it is being trained, without a copy;
a group's prompt runs through the prefill once (``prompt_rows``).
The session runs each as a program: sampling, the forward for the old log-probs
(``num_iterations`` > 1) and the training step.

With ``num_iterations`` = mu, a rollout (completions, advantages, old log-probs) serves mu
optimizer steps: the prompt batches come mu times each (the data order of TRL's repeat
sampler). Sampling at step t draws from ``default_rng([seed, t])``, so the completions are
a function of the seed, the step and the weights; the rollout being reused and the step
count ride in the checkpoint (:meth:`GRPO.optimizer_state`), so a resumed run continues
bit for bit.

Over turns (recipes/episodes.py): with ``tools`` (a Python file, recipes/tools.py) the
prompts are rendered with the tools' schemas in the chat template's ``tools``, sampling
stops at each closed ``<tool_call>`` (a Llama 3.x call, or a ``tool_call_style="json"``
one: at its end of turn), the call runs in its own process and the reply is fed to the
row as the template's tool turn, up to ``max_tool_calls`` calls; with an
``environment`` (recipes/environments.py) each episode's prompt is its environment's
first observation, and each end of turn is answered by ``step`` until it says done or the
completion's ``max_completion_length`` tokens are spent. Every episode of the batch stays
in the one batched sampler; the tokens fed (tool and environment turns) carry no label, so
the loss covers the model's own tokens; the reward functions see the episode's turns and
the environment's summed reward is one more reward column (weight: ``reward_weights``'
last), so the group advantage is over the whole episode. Episodes end inside their
rollout, so a resumed run replays them exactly when the environment is a function of the
prompt and the turns (the built-in ``guess`` is).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from toygraph import ops
from toygraph.core.graph import PHASES, Graph
from toygraph.data.batches import pad_id_for, steps_per_epoch
from toygraph.data.prompts import (encode_prompts, load_prompts, prompt_batches,
                                   prompt_text, prompt_token_ids)
from toygraph.errors import DataError, GraphError, ToygraphError
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.inference.batched import build_batched_generation, generate_rows
from toygraph.inference.sampling import SamplingOptions
from toygraph.models.decoder import (BuildOptions, LoraConfig, WeightSource, build_decoder,
                                     fused_head_loss)
from toygraph.recipes.base import RecipeOptions, fused_head
from toygraph.recipes.environments import environments
from toygraph.recipes.episodes import ToolRounds, call_ids, call_style
from toygraph.recipes.grpo_loss import (IMPORTANCE_SAMPLING, LOSS_TYPES, SCALE_REWARDS, Objective,
                                        build_objective, clipped, group_advantages)
from toygraph.recipes.lora import LoRA
from toygraph.recipes.options import AdapterOptions, option
from toygraph.recipes.registry import register
from toygraph.recipes.rewards import (REWARD_TIMEOUT, RewardError, nan_mean, nan_std,
                                      parse_rewards, score, weighted_total)
from toygraph.recipes.tools import STYLES, ToolBox

#: Defaults (TRL's, but a CPU-sized completion).
NUM_GENERATIONS, TEMPERATURE, TOP_P, MAX_COMPLETION_LENGTH, NUM_ITERATIONS = 8, 1.0, 1.0, 128, 1
#: Tool calls one completion may make (--max-tool-calls).
MAX_TOOL_CALLS = 4



@dataclass(kw_only=True)
class GRPOOptions(AdapterOptions):
    """GRPO's: the rewards, the tools and environment of an episode, the sampling and the
    objective (TRL's names, but ``kl_beta``: ``beta`` is the preference recipes')."""

    reward: list[str] = option((), help="grpo: a reward function (repeat the flag for more): "
                                        "regex:PATTERN, exact:FIELD, json, json-schema:FILE, "
                                        "length:MIN:MAX, or module:function (TRL's signature)",
                               group="run")
    reward_weights: tuple[str, ...] | None = option(None, help="grpo: the --reward functions' "
                                                               "weights, comma-separated; none: "
                                                               "1 each", group="run")
    reward_timeout: float = option(REWARD_TIMEOUT, help="grpo: seconds a module:function "
                                                        "reward or an environment may take per "
                                                        "call (each runs in a process of its "
                                                        "own); 0 = no limit",
                                   group="run", resume="free", low=0)
    # over turns (recipes/episodes.py): tools the completions call, an environment that
    # answers each turn
    tools: str | None = option(None, help="grpo: a Python file whose functions (type hints and "
                                          "a docstring each) the model may call: their JSON "
                                          "schemas reach the chat template's tools, each call "
                                          "is run (10 s at most) and its reply fed back as a "
                                          "tool turn", group="run")
    max_tool_calls: int = option(MAX_TOOL_CALLS, help="grpo: tool calls one completion may make "
                                                      "(with --tools); past them its calls get "
                                                      "no reply", group="run", low=1)
    tool_call_style: str | None = option(None, help="grpo: how the model writes a tool call "
                                                    "(with --tools): hermes/qwen (<tool_call> "
                                                    "tags), llama3, or json (a turn that is a "
                                                    "bare or ```json-fenced {\"name\", "
                                                    "\"arguments\"} object); default: the "
                                                    "format the chat template shows",
                                         group="run", choices=STYLES)
    environment: str | None = option(None, help="grpo: what answers each turn of an episode: "
                                                "env.py:Factory or module:Factory (reset(prompt) "
                                                "-> observation, step(text) -> (observation, "
                                                "reward, done)), or guess (a built-in guessing "
                                                "game); its reward takes one more "
                                                "--reward-weights entry, the last", group="run")
    num_generations: int = option(NUM_GENERATIONS, help="grpo: completions sampled per prompt "
                                                        "(a group)", group="steps", low=2)
    max_completion_length: int = option(MAX_COMPLETION_LENGTH,
                                        help="grpo: tokens a completion has at most (--seq-len "
                                             "bounds the prompt)", group="steps", low=1)
    temperature: float = option(TEMPERATURE, help="grpo: sampling temperature (the log-probs "
                                                  "are taken at it too, as TRL does)",
                                group="steps", low=0, open_low=True)
    top_p: float = option(TOP_P, help="grpo: nucleus sampling mass, in (0, 1]; 1 = off",
                          group="steps", low=0, open_low=True)
    num_iterations: int = option(NUM_ITERATIONS, help="grpo: optimizer steps per sampled batch "
                                                      "(the old log-probs are kept)",
                                 group="optimizer", low=1)
    loss_type: str = option(Objective.loss_type, help="grpo: how per-token losses are averaged "
                                                      "(TRL's loss_type)",
                            group="optimizer", choices=LOSS_TYPES)
    scale_rewards: str = option(Objective.scale_rewards,
                                help="grpo: divide advantages by the group's or the batch's "
                                     "reward std, or not", group="optimizer", choices=SCALE_REWARDS)
    importance_sampling: str = option(Objective.importance_sampling,
                                      help="grpo: importance ratio per token, or per sequence "
                                           "(GSPO)", group="optimizer", choices=IMPORTANCE_SAMPLING)
    epsilon: float = option(Objective.epsilon, help="grpo: clip the ratio below 1 - epsilon",
                            group="optimizer", low=0, high=1)
    epsilon_high: float | None = option(Objective.epsilon_high,
                                        help="grpo: clip the ratio above 1 + epsilon-high; none: "
                                             "epsilon (DAPO: 0.28)", group="optimizer", low=0)
    kl_beta: float = option(Objective.kl_beta, help="grpo: weight of the KL to the reference (the "
                                                    "adapter off); 0 = no reference pass",
                            group="optimizer", low=0)
    log_completions: int = option(0, help="grpo: put a sampled completion in the step event "
                                          "every N steps; 0 = never",
                                  group="evaluation", resume="free", low=0)

    def check(cfg):
        if cfg.max_tool_calls != MAX_TOOL_CALLS and cfg.tools is None:
            raise ToygraphError("--max-tool-calls needs --tools (the functions to call)")
        if cfg.tool_call_style is not None and cfg.tools is None:
            raise ToygraphError("--tool-call-style needs --tools (the functions to call)")
        if cfg.tools is not None and not Path(cfg.tools).is_file():
            raise ToygraphError(f"--tools {cfg.tools}: no such file")


def _environment_weight(rewards, weights, environment):
    """(the reward functions' weights, the environment's): with an environment,
    ``--reward-weights`` may hold one more number, its weight (default 1)."""
    n = len(list(rewards))
    if environment is None or not weights or len(weights) == n:
        return weights, 1.0
    if len(weights) != n + 1:
        raise RewardError(f"--reward-weights: {n} or {n + 1} numbers needed, one per --reward "
                          f"({n}) and optionally the --environment's, last; got {list(weights)}")
    try:
        last = float(weights[-1])
    except (TypeError, ValueError):
        raise RewardError(f"--reward-weights must be numbers, got {list(weights)}") from None
    if not math.isfinite(last):
        raise RewardError(f"--reward-weights: the --environment's weight must be finite, got "
                          f"{weights[-1]}")
    return (tuple(weights[:-1]) or None), last


@register("grpo")
class GRPO(LoRA):
    """Group Relative Policy Optimization (and DAPO, Dr. GRPO, BNPO, GSPO through the
    objective's options) with LoRA, from reward functions on sampled completions."""

    summary = "rewards on sampled completions, with LoRA"   # the --recipe help
    Options = GRPOOptions

    eval_unit = "prompts"
    load_data = staticmethod(load_prompts)
    encode_data = staticmethod(encode_prompts)

    def __init__(self, targets=LoraConfig.targets, rank: int = LoraConfig.rank,
                 alpha: float = LoraConfig.alpha, rewards=(), reward_weights=None,
                 num_generations: int = NUM_GENERATIONS, temperature: float = TEMPERATURE,
                 top_p: float = TOP_P, max_completion_length: int = MAX_COMPLETION_LENGTH,
                 num_iterations: int = NUM_ITERATIONS, objective: Objective | None = None,
                 log_completions: int = 0, reward_timeout: float = REWARD_TIMEOUT,
                 tools: str | None = None, max_tool_calls: int = MAX_TOOL_CALLS,
                 environment: str | None = None, template: str | None = None,
                 tool_call_style: str | None = None):
        super().__init__(targets, rank, alpha)
        if max_tool_calls < 1:
            raise GraphError(f"max_tool_calls must be >= 1, got {max_tool_calls}")
        weights, self.environment_weight = _environment_weight(rewards, reward_weights,
                                                               environment)
        self.rewards = (parse_rewards(rewards, weights, reward_timeout)
                        if rewards or environment is None else [])
        if num_generations < 2:
            raise GraphError(f"num_generations must be >= 2 (a group to compare), got {num_generations}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise GraphError(f"temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise GraphError(f"top_p must be in (0, 1], got {top_p}")
        if num_iterations < 1 or max_completion_length < 1 or log_completions < 0:
            raise GraphError("num_iterations and max_completion_length must be >= 1, "
                             "log_completions >= 0")
        self.num_generations, self.num_iterations = int(num_generations), int(num_iterations)
        self.sampling = SamplingOptions(temperature=float(temperature), top_p=float(top_p))
        self.max_completion_length = int(max_completion_length)
        self.objective = objective or Objective(max_completion_length=self.max_completion_length)
        if self.objective.max_completion_length != self.max_completion_length:
            raise GraphError("the objective's max_completion_length must be the recipe's")
        self.log_completions = int(log_completions)
        self.template, self.max_tool_calls = template, int(max_tool_calls)
        if tool_call_style is not None and tool_call_style not in STYLES:
            raise GraphError(f"tool_call_style {tool_call_style!r}: choose one of "
                             f"{', '.join(STYLES)}")
        self.tool_call_style = tool_call_style
        self.box = ToolBox(tools) if tools is not None else None
        self.envs = environments(environment, reward_timeout) if environment is not None else None
        self.prompts: dict[int, object] = {}   # prompt id -> EncodedPrompt (make_batches)
        self.rollout: dict | None = None
        self.last_metrics: dict = {}

    @classmethod
    def from_options(cls, cfg) -> "GRPO":
        objective = Objective(loss_type=cfg.loss_type, scale_rewards=cfg.scale_rewards,
                              importance_sampling=cfg.importance_sampling, epsilon=cfg.epsilon,
                              epsilon_high=cfg.epsilon_high, kl_beta=cfg.kl_beta,
                              max_completion_length=cfg.max_completion_length)
        return cls(targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha, rewards=cfg.reward,
                   reward_weights=cfg.reward_weights, num_generations=cfg.num_generations,
                   temperature=cfg.temperature, top_p=cfg.top_p,
                   max_completion_length=cfg.max_completion_length,
                   num_iterations=cfg.num_iterations, objective=objective,
                   log_completions=cfg.log_completions, reward_timeout=cfg.reward_timeout,
                   tools=cfg.tools, max_tool_calls=cfg.max_tool_calls,
                   environment=cfg.environment, template=cfg.template,
                   tool_call_style=cfg.tool_call_style)

    @property
    def reward_names(self) -> list[str]:
        """The columns of a rollout's rewards: the functions', then the environment's."""
        return [r.name for r in self.rewards] + (["environment"] if self.envs else [])

    @property
    def reward_weights(self) -> list[float]:
        return [r.weight for r in self.rewards] + ([self.environment_weight] if self.envs else [])

    def __repr__(self):
        return (f"GRPO(targets={self.targets}, rank={self.rank}, alpha={self.alpha}, "
                f"rewards={self.reward_names}, "
                f"num_generations={self.num_generations}, {self.objective})")

    # --- data ------------------------------------------------------------------------------------
    def make_batches(self, items, batch: int, seq_len: int, pad: int, *, shuffle: bool,
                     seed: int, epoch: int) -> list:
        """Training (``shuffle``): each batch of ``batch`` prompts ``num_iterations`` times.
        Evaluation: batches of ``batch x num_generations`` prompts, one greedy completion
        each, so every row of the sampler holds a prompt."""
        self.prompts.update({item.index: self.with_tools(item, seq_len) for item in items})
        if not shuffle:
            batch *= self.num_generations
        return prompt_batches(items, batch, seq_len, pad, shuffle=shuffle, seed=seed,
                              epoch=epoch, repeat=self.num_iterations if shuffle else 1)

    def with_tools(self, item, seq_len: int):
        """The prompt rendered with the tools' schemas in the chat template's ``tools``
        (the item as it is without --tools). Not cut to fit: the tools' description comes
        first, and the model must read it."""
        if self.box is None:
            return item
        known = self.prompts.get(item.index)
        if known is not None and known.row is item.row:   # rendered at an earlier epoch
            return known
        ids = prompt_token_ids(prompt_text(item.row, self.tok, self.box.schemas), self.tok)
        if len(ids) > seq_len:
            raise DataError(f"{item.row.path or '<data>'}:{item.line}: the prompt with the "
                            f"tools' schemas is {len(ids)} tokens, over --seq-len {seq_len}; "
                            "raise --seq-len")
        return replace(item, tokens=ids, truncated=False)

    def batches_per_epoch(self, items, batch: int, seq_len: int) -> int:
        return steps_per_epoch(len(items), batch) * self.num_iterations

    @staticmethod
    def packing_report(items, batch: int, seq_len: int) -> None:
        return None

    def labelled_share(self, items, batch: int, seq_len: int, pack: bool) -> None:
        return None   # completions are sampled: their share is not known before the run

    # --- the graph -------------------------------------------------------------------------------
    def check_options(self, opts: RecipeOptions) -> None:
        for bad, why in ((opts.data_parallel, "does not run data parallel (under mpirun) yet"),
                         (opts.pack, "does not pack: drop --pack"),
                         (opts.grad_accum > 1, "takes one micro-batch per step: raise --batch "
                                               "instead of --grad-accum")):
            if bad:
                raise GraphError(f"--recipe {self.name} {why}")

    def rows_per_batch(self, opts: RecipeOptions) -> int:
        return opts.batch * self.num_generations

    def batch_rows(self):
        return self.rows, "batch x num_generations completions"

    def build_graph(self, gguf, model_cfg, opts: RecipeOptions) -> Graph:
        """The training decoder over rows of prompt + completion, the per-token log-probs
        of the completions, the reference's (kl_beta > 0), the objective and the sampler."""
        self.check_model(model_cfg, opts)
        self.check_options(opts)
        self.opts, self.model_cfg = opts, model_cfg
        P, C = opts.seq_len, self.max_completion_length
        R = self.rows = self.rows_per_batch(opts)
        T = P + C
        if T > model_cfg.n_ctx:
            raise GraphError(f"--seq-len {P} + --max-completion-length {C} exceed the model's "
                             f"context length {model_cfg.n_ctx}")
        self.tok = Tokenizer.from_gguf(gguf.reader)
        self.tok.use_template(self.template)   # the prompts' (training/prepare.py)
        self.stop_ids, self.pad = self.tok.end_of_turn_ids, pad_id_for(self.tok)
        self.style, self.call_ids = None, set()
        if self.box is not None:
            self.style = self.tool_call_style or call_style(self.tok)
            if self.style is None:
                raise GraphError(f"--tools: the chat template ({self.tok.template_name}) shows "
                                 "no tool-call format GRPO's sampler stops on (Qwen2.5's and "
                                 "Hermes' <tool_call>, Llama 3.x's JSON calls); name the "
                                 "model's with --tool-call-style or give a template with "
                                 "--template FILE.jinja")
            self.call_ids = call_ids(self.tok, self.style)
        if self.envs is not None:   # each end of turn is the environment's
            self.call_ids |= set(self.stop_ids)
        self.graph = g = Graph()
        lora = self.lora_config(opts)
        source = WeightSource(gguf, self.weight_mode, seed=opts.seed)
        self.net = build_decoder(g, model_cfg, source, batch=R, seq_len=T, lora=lora,
                                 options=BuildOptions(logits=False))
        # The hidden row predicting each completion token, and the token (-1 past its end).
        self.keep = g.input("grpo.keep", (R * C,), "i32")
        self.labels = g.input("grpo.labels", (R * C,), "i32")
        self.logp = g.output(self.completion_logprobs(self.net))
        old = g.input("grpo.old_logp", (R, C)) if self.num_iterations > 1 else self.logp
        self.ref_logp = None
        if self.objective.kl_beta:
            self.ref_net = build_decoder(g, model_cfg, WeightSource(reference_of=self.net),
                                         batch=R, seq_len=T, options=BuildOptions(logits=False))
            self.ref_logp = g.output(self.completion_logprobs(self.ref_net))
        loss, self.objective_inputs, _ = build_objective(g, self.logp, old, self.ref_logp,
                                                         self.objective)
        self.loss, self.count = g.output(loss), None
        self.old_logp = old if old is not self.logp else None
        # The rollouts' G rows of a prompt share one prefill row (batch rows in all); a
        # prefill over every row serves evaluation (a prompt per row) and environments
        # whose first observations differ within a group.
        self.gen = build_batched_generation(g, model_cfg, rows=R, prompt_len=P, cache_len=T,
                                            prompt_rows=(opts.batch, R), lora=lora,
                                            shared=self.net)
        return g

    def completion_logprobs(self, net):
        """[R, C]: each completion token's log-prob under ``net`` at the sampling
        temperature (TRL divides the logits by it), 0 past the completion's end. Only the
        completion positions reach the head (get_rows), fused with it on CUDA as the
        preference recipes do."""
        R, C = self.rows, self.max_completion_length
        rows = ops.get_rows(net.hidden, self.keep)
        cap = self.model_cfg.logit_softcap
        if cap:   # Gemma 4: the temperature divides the capped logits, as in transformers
            logits = ops.softcap(ops.matmul(rows, net.head, trans_b=True), cap)
            logits = ops.scale(logits, 1.0 / self.sampling.temperature)
            return ops.token_logprobs(logits, self.labels).reshape(R, C)
        h = ops.scale(rows, 1.0 / self.sampling.temperature)
        if fused_head(self.opts.backend, self.model_cfg, h.shape[0]):
            nll = fused_head_loss(net, h, self.labels, "none")
            return ops.scale(nll, -1.0).reshape(R, C)
        logits = ops.matmul(h, net.head, trans_b=True)
        return ops.token_logprobs(logits, self.labels).reshape(R, C)

    def realize(self, gguf, model_cfg, opts: RecipeOptions) -> None:
        super().realize(gguf, model_cfg, opts)
        skip = {t.id for t in self.gen.targets}
        g = self.graph
        targets = [t for p in PHASES for t in g.outputs[p] + g.effects[p] if t.id not in skip]
        self.train_program = self.sess.program(targets)
        self.old_program = self.sess.program([self.logp]) if self.old_logp is not None else None
        self.rollout = None

    # --- per step --------------------------------------------------------------------------------
    def step(self, token_ids, positions, labels, hp, is_first: bool, segments=None) -> float:
        """Sample, score and update (module docstring); the arrays are the prompt batch,
        [1, batch, seq_len]."""
        labels = np.asarray(labels)
        if labels.shape != (1, self.opts.batch, self.opts.seq_len):
            raise GraphError(f"step: a prompt batch must be [1, batch, seq_len] = "
                             f"{(1, self.opts.batch, self.opts.seq_len)}, got {labels.shape}")
        t = self.step_index + 1
        gen_s = 0.0
        if self.rollout is None or (t - 1) % self.num_iterations == 0:
            t0 = time.perf_counter()
            self.rollout = self.make_rollout(labels[0, :, 0], np.random.default_rng([self.opts.seed, t]))
            gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = self.sess
        if is_first:
            s.reset()
        else:
            s.reset_grads()
        self.upload_rollout(self.rollout)
        s.upload(self.train.hp, hp)
        s.run_program(self.train_program)
        loss = float(s.download(self.loss))
        self.step_index += 1
        self.last_metrics = self.metrics(self.rollout, loss)
        self.last_metrics.update({"time/generation_s": gen_s,
                                  "time/update_s": time.perf_counter() - t0})
        if self.log_completions and t % self.log_completions == 0:
            self.last_metrics["sample"] = self.sample(self.rollout)
        return loss

    def make_rollout(self, prompt_ids, rng, opts: SamplingOptions | None = None) -> dict:
        """Sample ``num_generations`` episodes of each prompt, score them and build the
        training rows: tokens [R, T], keep and labels [R * C] (-1 on the tokens the model
        did not write: tool and environment turns), advantages [R] (of each whole
        episode's reward), the rewards [R, F] (NaN: not applied; the environment's last),
        the old log-probs [R, C] when num_iterations > 1, and the tool calls / environment
        steps [R] of each episode where there are tools / an environment."""
        items = [self.prompts[int(i)] for i in prompt_ids]
        G, P, C = self.num_generations, self.opts.seq_len, self.max_completion_length
        group = [it for it in items for _ in range(G)]
        prompts, completions, own, rounds = self.sample_episodes(group, opts or self.sampling, rng)
        rewards = self.score(group, completions, rounds)
        total = weighted_total(rewards, self.reward_weights)
        adv, degenerate = group_advantages(total, G, self.objective.scale_rewards)
        R, T = len(group), P + C
        tokens = np.full((R, T), self.pad, np.int32)
        keep = np.zeros((R, C), np.int32)
        labels = np.full((R, C), -1, np.int32)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            tokens[r, :len(p) + len(c)] = p + c
            keep[r] = r * T + len(p) - 1 + np.arange(C)
            labels[r, :len(c)] = np.where(own[r], c, -1) if own is not None else c
        out = {"prompts": np.asarray(prompt_ids, np.int64), "tokens": tokens,
               "keep": keep.reshape(-1), "labels": labels.reshape(-1), "advantages": adv,
               "rewards": rewards, "degenerate": degenerate}
        if rounds is not None and self.box is not None:
            out["tool_calls"] = np.array(rounds.calls, np.int32)
        if rounds is not None and self.envs is not None:
            out["environment_steps"] = np.array([len(x) for x in rounds.rewards], np.int32)
        if self.old_logp is not None:
            self.upload_rows(out)
            self.sess.run_program(self.old_program)
            out["old_logp"] = self.sess.download(self.logp)
        return out

    def sample_episodes(self, group: list, opts: SamplingOptions, rng):
        """(prompts, completions, own, rounds) of one batch of the sampler's rows: each
        row's prompt ids and completion, and with tools or an environment whether each
        completion token is the model's (generate_rows' ``own``) and the ToolRounds that
        fed the others (None, None without)."""
        C = self.max_completion_length
        if self.box is None and self.envs is None:
            prompts = [it.tokens for it in group]
            return prompts, generate_rows(self.sess, self.gen, prompts, C, opts, rng,
                                          self.stop_ids, self.pad), None, None
        envs = [self.envs.new() for _ in group] if self.envs is not None else None
        chats = ([it.row.prompt for it in group] if envs is None else
                 [[{"role": "user", "content": env.reset(it.row.prompt)}]
                  for env, it in zip(envs, group)])
        prompts = ([it.tokens for it in group] if envs is None else
                   [self.first_observation_ids(chat, it) for chat, it in zip(chats, group)])
        rounds = ToolRounds(self.tok, self.box, self.style, chats, self.max_tool_calls,
                            envs=envs, stop_ids=self.stop_ids)
        own: list = []
        try:
            completions = generate_rows(self.sess, self.gen, prompts, C, opts, rng,
                                        self.stop_ids, self.pad, call_ids=self.call_ids,
                                        tool_turn=rounds, own=own)
        finally:
            for env in envs or ():
                env.close()
        return prompts, completions, own, rounds

    def first_observation_ids(self, chat: list[dict], item) -> list[int]:
        """The prompt of an environment's episode: its first observation as the user turn,
        rendered with the generation prompt (and the tools' schemas)."""
        tools = self.box.schemas if self.box is not None else None
        text = self.tok.apply_chat_template(chat, add_generation_prompt=True, tools=tools)
        ids = prompt_token_ids(text, self.tok)
        if len(ids) > self.opts.seq_len:
            raise DataError(f"{item.row.path or '<data>'}:{item.line}: the environment's first "
                            f"observation of this prompt is {len(ids)} tokens as a user turn, "
                            f"over --seq-len {self.opts.seq_len}; raise --seq-len")
        return ids

    def score(self, group: list, completions: list[list[int]], rounds=None) -> np.ndarray:
        """The rewards [R, F] of the completions (TRL's arguments: the prompts as given,
        the completions as text, or as messages for a chat prompt: an assistant message,
        or an episode's turns after its prompt), the environment's summed reward last."""
        texts = [self.tok.decode(c, skip_special_tokens=True) for c in completions]
        chat = [it.row.conversational or self.envs is not None for it in group]
        keys = sorted({k for it in group for k in it.row.fields})
        fields = {k: [it.row.fields.get(k) for it in group] for k in keys}
        fields["completion_ids"] = [list(c) for c in completions]
        if rounds is None:
            given = [[{"role": "assistant", "content": x}] if c else x
                     for x, c in zip(texts, chat)]
        else:
            given = [rounds.completion_messages(r, c) if chat[r] else texts[r]
                     for r, c in enumerate(completions)]
        out = score(self.rewards, [it.row.prompt for it in group], given, fields)
        if self.envs is None:
            return out
        episode = np.array([sum(x) for x in rounds.rewards[:len(completions)]], np.float64)
        return np.concatenate([out, episode[:, None]], axis=1)

    def upload_rows(self, rollout: dict) -> None:
        s, R, T = self.sess, self.rows, self.opts.seq_len + self.max_completion_length
        s.upload(self.net.tokens, rollout["tokens"])
        s.upload(self.net.positions, np.tile(np.arange(T, dtype=np.int32), (R, 1)))
        s.upload(self.keep, rollout["keep"])
        s.upload(self.labels, rollout["labels"])

    def upload_rollout(self, rollout: dict) -> None:
        self.upload_rows(rollout)
        mask = rollout["labels"].reshape(self.rows, -1) >= 0
        self.objective_inputs.upload(self.sess, mask, rollout["advantages"])
        if self.old_logp is not None:
            self.sess.upload(self.old_logp, rollout["old_logp"])

    # --- metrics ---------------------------------------------------------------------------------
    def metrics(self, rollout: dict, loss: float) -> dict:
        """TRL's step metrics: rewards (total and per function), degenerate groups,
        completion lengths, clip ratios and, with kl_beta > 0, the KL to the reference."""
        rewards = rollout["rewards"]
        total = weighted_total(rewards, self.reward_weights)
        mask = rollout["labels"].reshape(self.rows, -1) >= 0
        lengths = mask.sum(axis=1)
        out = {"loss": loss, "reward": nan_mean(total), "reward_std": nan_std(total),
               "frac_reward_zero_std": float(np.mean(rollout["degenerate"])),
               "completions/mean_length": float(lengths.mean()),
               "completions/max_length": int(lengths.max())}
        for key, name in (("tool_calls", "tools/calls_mean"),
                          ("environment_steps", "environment/steps_mean")):
            if key in rollout:
                out[name] = float(np.mean(rollout[key]))
        for j, name in enumerate(self.reward_names):
            out[f"rewards/{name}/mean"] = nan_mean(rewards[:, j])
            out[f"rewards/{name}/std"] = nan_std(rewards[:, j])
        logp = self.sess.download(self.logp).astype(np.float64)
        old = rollout.get("old_logp", logp).astype(np.float64)
        adv = rollout["advantages"][:, None]
        if self.objective.importance_sampling == "token":
            hit = clipped(np.exp(logp - old), adv, self.objective)
            out["clip_ratio"] = float(hit[mask].mean()) if mask.any() else 0.0
        else:
            seq = ((logp - old) * mask).sum(1) / np.maximum(lengths, 1)
            out["clip_ratio"] = float(clipped(np.exp(seq), adv[:, 0], self.objective).mean())
        if self.ref_logp is not None:
            d = self.sess.download(self.ref_logp).astype(np.float64) - logp
            out["kl"] = float(((np.expm1(d) - d) * mask).sum() / max(mask.sum(), 1))
        return out

    def sample(self, rollout: dict) -> dict:
        """The first completion of the rollout with its prompt and rewards (--log-completions)."""
        item = self.prompts[int(rollout["prompts"][0])]
        c = rollout["labels"].reshape(self.rows, -1)[0]
        prompt, completion = prompt_text(item.row, self.tok), [int(x) for x in c[c >= 0]]
        if self.box is not None or self.envs is not None:   # the episode, its fed turns too
            n, mine = int(rollout["keep"][0]) + 1, np.nonzero(c >= 0)[0]
            end = n + (int(mine[-1]) + 1 if len(mine) else 0)
            prompt = self.tok.decode(rollout["tokens"][0, :n])
            completion = [int(x) for x in rollout["tokens"][0, n:end]]
        return {"prompt": prompt,
                "completion": self.tok.decode(completion, skip_special_tokens=True),
                "rewards": {name: (None if math.isnan(v) else float(v))
                            for name, v in zip(self.reward_names, rollout["rewards"][0])}}

    @staticmethod
    def metrics_text(metrics: dict) -> str:
        if "reward" not in metrics:
            return ""
        text = f"reward {metrics['reward']:.3f}"
        if "completions/mean_length" in metrics:   # a step (an evaluation has only rewards)
            text += (f" ±{metrics['reward_std']:.2f} flat {metrics['frac_reward_zero_std']:.2f} "
                     f"len {metrics['completions/mean_length']:.0f}"
                     + (f" kl {metrics['kl']:.4f}" if "kl" in metrics else "")
                     + f" gen {metrics['time/generation_s']:.1f}s upd "
                     f"{metrics['time/update_s']:.1f}s")
        return text

    # --- evaluation ------------------------------------------------------------------------------
    def evaluate(self, token_ids, positions, labels, segments=None) -> tuple[float, int]:
        """Greedy completions of one evaluation batch [rows, seq_len], scored: returns (minus
        the summed total reward, prompts), so the validation "loss" is minus the mean
        reward and the best checkpoint has the highest; the per-function means go to
        ``last_metrics``. Rows that only fill the last batch are left out."""
        labels = np.asarray(labels)
        real = labels[:, 1] == 0
        if len(labels) > self.rows:
            raise GraphError(f"evaluate: {len(labels)} prompts for {self.rows} sampler rows")
        ids = list(labels[real, 0]) + [labels[0, 0]] * (self.rows - int(real.sum()))
        items = [self.prompts[int(i)] for i in ids]
        _, completions, _, rounds = self.sample_episodes(items, SamplingOptions(), None)
        n = int(real.sum())
        rewards = self.score(items[:n], completions[:n], rounds)
        total = weighted_total(rewards, self.reward_weights)
        self.last_metrics = {"reward": nan_mean(total)}
        self.last_metrics.update({f"rewards/{name}/mean": nan_mean(rewards[:, j])
                                  for j, name in enumerate(self.reward_names)})
        return -float(np.nansum(total)), n

    # --- state a checkpoint keeps ----------------------------------------------------------------
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """AdamW's moments, and what else the next step needs to continue exactly: the
        step count and the rollout being reused (its arrays, finite: a NaN reward is
        stored as 0 with ``scored`` 0)."""
        out = super().optimizer_state()
        out["grpo.step"] = np.array([self.step_index], np.float32)
        if self.rollout is not None:
            r = dict(self.rollout)
            rewards = r.pop("rewards")
            r["rewards"], r["scored"] = np.nan_to_num(rewards, nan=0.0), ~np.isnan(rewards)
            out.update({f"grpo.rollout.{k}": np.asarray(v, np.float32) for k, v in r.items()})
        return out

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        state = dict(state)
        if "grpo.step" in state:
            self.step_index = int(state.pop("grpo.step")[0])
        saved = {k.split(".", 2)[2]: state.pop(k) for k in list(state)
                 if k.startswith("grpo.rollout.")}
        if saved:
            ints = ("prompts", "tokens", "keep", "labels", "tool_calls", "environment_steps")
            r = {k: (v.astype(np.int64 if k == "prompts" else np.int32) if k in ints else v)
                 for k, v in saved.items()}
            r["rewards"] = np.where(r.pop("scored") > 0, r["rewards"].astype(np.float64), np.nan)
            r["degenerate"] = r["degenerate"] > 0
            r["advantages"] = r["advantages"].astype(np.float64)
            self.rollout = r
        super().load_optimizer_state(state)

