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

GRPO (recipes/grpo.py, ``--tools``, ``--max-tool-calls``, ``--environment``) samples
its episodes with ``ToolRounds`` here inside the batched sampler (generate_rows'
``call_ids``/``tool_turn``/``own``: a tool's reply or an environment's observation fed
through the row's KV cache as forced tokens, marked as not the model's, so their labels
are masked); a Hermes/Qwen2.5 call stops sampling at its ``</tool_call>``, a Llama 3.x
JSON call (and a ``json``-style one, tools.py) at the end of its turn. Not wired: a
per-episode turn limit for environments (the completion's token budget bounds an episode); Llama 3.x's calls are tested on a
Llama-3-layout template over the tiny vocabulary, not on a real Llama 3.x file. The loops
above (``tool_episode``, ``environment_episode``) run one episode at a time on any
``generate``; the user's environments run in a process of their own
(recipes/environments.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toygraph.data.examples import Example
from toygraph.recipes.tools import TURN_STYLES, ToolBox, parse_tool_calls

#: Where sampling stops so that a call can be run: the closing tag (Hermes, Qwen2.5); a
#: Llama 3.x call ends its turn (<|eom_id|>, an end-of-turn token) and needs no string.
CALL_STOPS = {"qwen": ("</tool_call>",), "hermes": ("</tool_call>",), "llama3": (),
              "json": ()}


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


def tool_turn_ids(tok, messages: list[dict], call_text: str, reply: str,
                  tools: list[dict] | None = None) -> list[int]:
    """The tokens a tool round feeds a row after the model's call (generate_rows'
    ``tool_turn``): the rest of the assistant turn as the template closes it, the tool
    turn holding ``reply``, and the next assistant turn's start -- the template's own
    rendering of the round, past what the model wrote (``call_text``, after the rendering
    of ``messages`` with the generation prompt). A DataError when the template does not
    render the round as a continuation of the turn (not prefix-consistent)."""
    return round_ids(tok, messages, call_text, [{"role": "tool", "content": reply}], tools)


def round_ids(tok, messages: list[dict], said: str, turns: list[dict],
              tools: list[dict] | None = None, emitted: str = "") -> list[int]:
    """tool_turn_ids for any next ``turns`` (tools' replies, an environment's observation
    as a user turn). ``emitted``: what the model wrote of the turn's closing itself (the
    end-of-turn token it stopped on), left out of the tokens fed. A template that trims
    the assistant's text (Llama 3.x's ``content | trim``) is followed from the trimmed
    text."""
    from toygraph.errors import DataError
    before = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    for shown in dict.fromkeys((said, said.strip())):
        mine = messages + [{"role": "assistant", "content": shown}]
        closed = tok.apply_chat_template(mine, tools=tools)
        after = tok.apply_chat_template(mine + turns, add_generation_prompt=True, tools=tools)
        if closed.startswith(before + shown) and after.startswith(closed):
            break
    else:
        raise DataError(f"the chat template ({tok.template_name}) does not render a "
                        f"{turns[0]['role']} turn as a continuation of the assistant's turn; "
                        "tool rounds and environments need a prefix-consistent template "
                        "(--template FILE.jinja)")
    closing = closed[len(before) + len(shown):]
    if emitted and closing.startswith(emitted):
        closing = closing[len(emitted):]
    return tok.encode(closing + after[len(closed):], add_bos=False, add_eos=False)


#: The text that closes a call, where sampling stops to run it (CALL_STOPS' strings).
CALL_CLOSE = {"qwen": "</tool_call>", "hermes": "</tool_call>"}


def call_style(tok) -> str | None:
    """The tool-call format the chat template in use shows (tools.STYLES), or None: a
    template that writes ``<tool_call>`` is Hermes' (Qwen2.5's); one with an ``ipython``
    role and ``"parameters"`` (or ``<|python_tag|>``) Llama 3.x's JSON calls."""
    source = tok.chat_template or ""
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source):
        return "llama3"
    return None


def call_ids(tok, style: str) -> set[int]:
    """The tokens on which a call may close (generate_rows' ``call_ids``): Llama 3.x's
    calls end the turn (``<|eot_id|>``/``<|eom_id|>``: the end-of-turn tokens); a
    Hermes call its closing tag, the tag's own token where the vocabulary has one, else
    every token ending with its last character (ToolRounds then answers only a text that
    ends with the tag)."""
    if style in TURN_STYLES:
        return set(tok.end_of_turn_ids)
    close = CALL_CLOSE[style]
    single = tok.token_to_id(close)
    if single is not None:
        return {single}
    return {i for i in range(tok.vocab_size) if tok.decode([i]).endswith(close[-1])}


class ToolRounds:
    """generate_rows' ``tool_turn`` for rows whose prompts are ``prompts`` (chat messages,
    rendered with ``box.schemas`` as the template's tools). Sampling stops at each call's
    closing token, so each Hermes round is one call: the one the row's text since its
    last tool turn closes, run by ``box`` and answered with ``tool_turn_ids``; a Llama 3.x
    call ends its turn (one of ``stop_ids``), and each call of that turn gets a tool turn.
    After ``max_tool_calls`` calls in a row, or for text holding no call, nothing is fed.

    With ``envs`` (one environment per row, reset already; ``prompts`` then hold its first
    observation as the user turn) the row's turn ending on one of ``stop_ids`` is its
    environment's ``step``: the reward is kept (``rewards``), and unless the environment
    says done its observation is fed as the next user turn, the model's end-of-turn token
    being the first of the template's closing. ``box`` may be None (no tools)."""

    def __init__(self, tok, box: ToolBox | None, style: str | None, prompts: list[list[dict]],
                 max_tool_calls: int, envs: list | None = None, stop_ids=()):
        self.tok, self.box, self.style, self.max = tok, box, style, max_tool_calls
        self.envs, self.stop = envs, {int(i) for i in stop_ids}
        self.tools = box.schemas if box is not None else None
        self.prompt_turns = [len(p) for p in prompts]
        self.messages = [list(p) for p in prompts]   # per row: the conversation so far
        self.fed = [0] * len(prompts)                # per row: completion tokens rendered
        self.calls = [0] * len(prompts)
        self.rewards: list[list[float]] = [[] for _ in prompts]   # per row: each step's
        self.done = [False] * len(prompts)           # the environment said so

    def __call__(self, r: int, completion: list[int]) -> list[int]:
        said = completion[self.fed[r]:]
        ended = bool(said) and said[-1] in self.stop   # the turn's end (a Llama 3.x call's)
        if self.box is not None and ended == (self.style in TURN_STYLES):
            ids = self._tool_round(r, completion, said, ended)
            if ids:
                return ids
        if self.envs is not None and ended:
            return self._environment_turn(r, completion, said)
        return []

    def _tool_round(self, r: int, completion: list[int], said: list[int], ended: bool):
        """A Hermes turn's one closed call, or a Llama 3.x turn's calls, each answered by a
        tool turn; [] when the text holds no call or the row has made its calls."""
        text = self.tok.decode(said[:-1] if ended else said)
        if self.style in CALL_CLOSE and not text.endswith(CALL_CLOSE[self.style]):
            return []
        calls = parse_tool_calls(text, self.style)
        if not calls or self.calls[r] >= self.max:
            return []
        calls = calls[-1:] if self.style in CALL_CLOSE else calls[:self.max - self.calls[r]]
        replies = [{"role": "tool", "content": self.box.reply(c)} for c in calls]
        ids = round_ids(self.tok, self.messages[r], text, replies, self.tools,
                        emitted=self.tok.decode(said[-1:]) if ended else "")
        self.messages[r] += [{"role": "assistant", "content": text}, *replies]
        self.calls[r] += len(calls)
        self.fed[r] = len(completion) + len(ids)
        return ids

    def _environment_turn(self, r: int, completion: list[int], said: list[int]) -> list[int]:
        text = self.tok.decode(said[:-1])
        observation, reward, done = self.envs[r].step(text)
        self.rewards[r].append(reward)
        self.messages[r].append({"role": "assistant", "content": text})
        self.fed[r] = len(completion)
        if done:
            self.done[r] = True
            return []
        turn = {"role": "user", "content": observation}
        ids = round_ids(self.tok, self.messages[r][:-1], text, [turn], self.tools,
                        emitted=self.tok.decode(said[-1:]))
        self.messages[r].append(turn)
        self.fed[r] += len(ids)
        return ids

    def completion_messages(self, r: int, completion: list[int]) -> list[dict]:
        """Row r's episode after its prompt: the turns it added, and the model's last
        one (its text since the last turn fed, special tokens left out). An episode always
        ends in a turn of the model's: when the completion's tokens ran out right after a
        tool reply or an observation was fed, that turn is empty, so a reward reading the
        last turn reads the model's silence, never the tool's reply as the model's answer."""
        turns = self.messages[r][self.prompt_turns[r]:]
        rest = self.tok.decode(completion[self.fed[r]:], skip_special_tokens=True)
        unanswered = bool(turns) and turns[-1]["role"] != "assistant"
        return turns + ([{"role": "assistant", "content": rest}] if rest or unanswered else [])
