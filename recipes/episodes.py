"""Episodes over turns for GRPO (issue 50, items 1 and 2): a completion that calls tools
gets their replies as tool turns and goes on, up to ``max_tool_calls`` rounds; an
environment (``reset(prompt) -> observation``, ``step(text) -> (observation, reward,
done)``) drives several turns.

>>> ep = tool_episode(generate, box, [{"role": "user", "content": "12*7?"}], "qwen",
...                   max_tool_calls=2)                                  # doctest: +SKIP
>>> ep.messages[-1]["content"], ep.tool_calls                            # doctest: +SKIP
('84', 1)

Both loops take ``generate(messages, stop) -> text``: the model's next assistant turn
after ``messages``, sampling stopped at an end of turn or one of the ``stop`` strings
(cut off before it, as ``LanguageModel.generate`` does). ``model_generate`` makes one
from a LanguageModel, rendering the tools' schemas into the chat template's ``tools``.

An episode is its messages: the assistant turns are the model's own text, every other
turn (a tool's reply, an environment's observation) is not, so ``episode_example`` gives
the SFT encoder (data/encoding.py) a row whose loss covers only the model's tokens.

What is wired: nothing in the trainer yet. GRPO's batched sampler still samples one
completion per prompt; ``--tools``, ``--environment``, ``--max-tool-calls``, the group
advantage over whole episodes, combining an environment's reward with the reward
functions, and resuming an episode are not built. This module is the loop they will run,
with recipes/tools.py's ToolBox and recipes/environments.py's ``environments(spec)``
(the user's environments in a process of their own).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toygraph.data.examples import Example
from toygraph.recipes.tools import ToolBox, parse_tool_calls

#: Where sampling stops so that a call can be run: the closing tag (Hermes, Qwen2.5); a
#: Llama 3.x call ends its turn (<|eom_id|>, an end-of-turn token) and needs no string.
CALL_STOPS = {"qwen": ("</tool_call>",), "hermes": ("</tool_call>",), "llama3": ()}


@dataclass
class Episode:
    messages: list[dict]             # the prompt's, then the turns the episode added
    tool_calls: int = 0              # calls run (each a tool turn)
    rewards: list[float] = field(default_factory=list)   # the environment's, per step
    done: bool = False               # the environment said so, or the model answered

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))


def tool_episode(generate, box: ToolBox, messages: list[dict], style: str,
                 max_tool_calls: int) -> Episode:
    """The model answers ``messages``; each turn with tool calls gets one tool turn per
    call (``box.reply``: the value, or a one-line error) and the model goes on, until a
    turn calls nothing or ``max_tool_calls`` calls have run (the last turn is then the
    model's, whatever it holds)."""
    ep = Episode(list(messages))
    stop = CALL_STOPS[style]
    while True:
        text = _closed(generate(ep.messages, stop), style)
        ep.messages.append({"role": "assistant", "content": text})
        calls = parse_tool_calls(text, style)
        if not calls or ep.tool_calls >= max_tool_calls:
            ep.done = not calls
            return ep
        for call in calls[:max_tool_calls - ep.tool_calls]:
            ep.messages.append({"role": "tool", "content": box.reply(call),
                                **({"name": call.name} if hasattr(call, "name") else {})})
            ep.tool_calls += 1


def _closed(text: str, style: str) -> str:
    """The turn as the model wrote it: sampling cut the closing tag it stopped on."""
    if style in ("qwen", "hermes") and text.count("<tool_call>") > text.count("</tool_call>"):
        return text + "</tool_call>"
    return text


def environment_episode(generate, env, prompt, max_turns: int) -> Episode:
    """``env.reset(prompt)``'s observation as the first user turn, then up to
    ``max_turns`` model turns, each answered by ``env.step(text)``: its reward recorded,
    its observation the next user turn unless it says done."""
    ep = Episode([{"role": "user", "content": str(env.reset(prompt))}])
    for _ in range(max_turns):
        text = generate(ep.messages, ())
        ep.messages.append({"role": "assistant", "content": text})
        observation, reward, done = env.step(text)
        ep.rewards.append(float(reward))
        if done:
            ep.done = True
            break
        ep.messages.append({"role": "user", "content": str(observation)})
    return ep


def episode_example(ep: Episode, tools: list[dict] | None = None) -> Example:
    """The episode as a chat row for the SFT encoder: its assistant turns the targets."""
    return Example(messages=ep.messages, tools=tools)


def model_generate(lm, tools: list[dict] | None = None, max_new_tokens: int = 128, **sampling):
    """``generate(messages, stop)`` of a LanguageModel: the chat template rendered with
    ``tools`` and the generation prompt, then ``lm.generate`` from those ids."""
    tok = lm.tokenizer

    def generate(messages, stop):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        double = tok.bos_token is not None and text.startswith(tok.bos_token)
        ids = tok.encode(text, add_bos=False if double else None)
        return lm.generate(ids, max_new_tokens=max_new_tokens, stop=list(stop), **sampling)

    return generate
