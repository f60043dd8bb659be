"""GRPO over turns (issue 50, items 1 and 2; recipes/episodes.py): the --tools,
--max-tool-calls and --environment options, prompts rendered with the tools' schemas,
rollouts whose completions call tools or talk to an environment, and a loss over the
model's own tokens only."""
import json
import re

import numpy as np
import pytest

from toygraph.core.optimizer import hp_row
from toygraph.errors import ToygraphError
from toygraph.fixtures.tiny_models import write_tiny_llama
from toygraph.inference import batched
from toygraph.models.model import GGUFModel
from toygraph.recipes import GRPO, RecipeOptions
from toygraph.recipes.grpo_loss import token_weights
from toygraph.training import RunConfig, run_training

TOOLS = '''
def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: what to say
    """
    return text.upper() + "!"


def hang() -> str:
    """Never answer."""
    import time
    time.sleep(60)


def boom(x: int) -> str:
    """Fail."""
    raise ValueError("no " * 1000)
'''

#: A small Hermes-style template (Qwen2.5's layout, a short tools line): prefix-consistent,
#: so a tool round renders as a continuation of the assistant's turn.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}{%- for t in tools %}"
    "{{- ' ' + t.function.name }}{%- endfor %}{{- ' via <tool_call>{}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SHOUT = '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
WORDS = "abcdefgh"


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return path


def config(**kw):
    base = dict(model="m.gguf", data="d.jsonl", out="runs/x", recipe="grpo", reward=("json",))
    return RunConfig(**{**base, **kw})


def test_the_options_are_checked_naming_the_flag(tools_file, tmp_path):
    config(tools=str(tools_file), max_tool_calls=2, environment="guess").validate()
    for kw, needle in ((dict(recipe="lora", reward=(), tools=str(tools_file)),
                        "--tools is for --recipe grpo"),
                       (dict(recipe="lora", reward=(), environment="guess"),
                        "--environment is for --recipe grpo"),
                       (dict(max_tool_calls=2), "--max-tool-calls needs --tools"),
                       (dict(tool_call_style="json"), "--tool-call-style needs --tools"),
                       (dict(tools=str(tools_file), tool_call_style="xml"),
                        "--tool-call-style must be one of qwen, hermes, llama3, json"),
                       (dict(tools=str(tools_file), max_tool_calls=0),
                        "--max-tool-calls must be an integer >= 1"),
                       (dict(tools=str(tmp_path / "none.py")), "--tools .*none.py: no such file")):
        with pytest.raises(ToygraphError, match=needle) as e:
            config(**kw).validate()
        assert "\n" not in str(e.value)


def test_the_python_api_takes_tools_and_environments(tools_file):
    recipe = GRPO(rewards=["json"], tools=str(tools_file), max_tool_calls=2)
    assert recipe.box.names == ["shout", "hang", "boom"] and recipe.max_tool_calls == 2
    recipe.box.close()
    # an environment alone is a reward; its weight is --reward-weights' last entry
    assert GRPO(environment="guess").reward_names == ["environment"]
    both = GRPO(rewards=["json"], reward_weights=("0.5", "2"), environment="guess")
    assert both.reward_names == ["json", "environment"] and both.reward_weights == [0.5, 2.0]
    assert GRPO(rewards=["json"], reward_weights=("3",), environment="guess").reward_weights == [3.0, 1.0]
    for kw, needle in ((dict(environment="nonsense"), "expected module:Factory"),
                       (dict(rewards=[]), "GRPO needs at least one --reward"),
                       (dict(environment="guess", reward_weights=("1", "2")),
                        r"0 or 1 numbers needed, one per --reward \(0\) and optionally the "
                        "--environment's"),
                       (dict(rewards=["json"], tools="/nonexistent/tools.py"),
                        "--tools /nonexistent/tools.py: cannot load it"),
                       (dict(rewards=["json"], tools="x.py", max_tool_calls=0),
                        "max_tool_calls must be >= 1")):
        with pytest.raises(ToygraphError, match=needle):
            GRPO(**kw)


# --- rollouts that call tools ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny model with room for a tools prompt, a call and its tool turn."""
    return write_tiny_llama(tmp_path_factory.mktemp("grpo2") / "tiny-256.gguf", n_ctx=256)


def chat_prompts(folder):
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"say {w}"}]})
                            + "\n" for w in WORDS))
    return path


def reward_file(folder):
    """A reward that varies with the text (so the advantages are not all 0)."""
    path = folder / "varied.py"
    path.write_text("def varied(completions, **kw):\n"
                    "    text = [c[-1]['content'] if isinstance(c, list) else c for c in completions]\n"
                    "    return [float(sum(map(ord, t)) % 5) for t in text]\n")
    return f"{path}:varied"


def scripted(monkeypatch, calls, turn_start="<|im_start|>assistant\n", reply="<tool_response>"):
    """The sampler writes ``calls[n]`` at the start of an assistant turn that follows n
    tool replies (then samples as usual): a tiny random model makes no calls itself.
    The real sampler still draws each token (the same random stream)."""
    real = batched.pick_token
    tok = {}

    def pick(logits, context, opts, rng):
        t = real(logits, context, opts, rng)
        text = tok["tok"].decode(context)
        turn = text.rsplit(turn_start, 1)
        n = text.count(reply)
        if len(turn) == 2 and n < len(calls) and calls[n].startswith(turn[1]) \
                and turn[1] != calls[n]:
            want = tok["tok"].encode(calls[n][len(turn[1]):], add_bos=False)
            return want[0]
        return t

    monkeypatch.setattr(batched, "pick_token", pick)
    return tok


def tool_recipe(model_path, data, tmp_path, tools_file, **kw):
    from toygraph.data.prompts import encode_prompts, load_prompts
    (tmp_path / "hermes.jinja").write_text(TEMPLATE)
    model = GGUFModel(model_path)
    recipe = GRPO(rewards=[reward_file(tmp_path)], num_generations=4, max_completion_length=140,
                  tools=str(tools_file), template=str(tmp_path / "hermes.jinja"), **kw)
    opts = RecipeOptions(seq_len=80, batch=1, seed=3, init_scale=0.3)
    recipe.realize(model, model.config, opts)
    items = encode_prompts(load_prompts(data), recipe.tok, 80).items
    recipe.make_batches(items, 1, 80, recipe.pad, shuffle=False, seed=0, epoch=0)
    return recipe, items


def test_a_completion_calls_a_tool_and_its_turn_carries_no_loss(long_llama, tmp_path, tools_file,
                                                                monkeypatch):
    from toygraph.recipes.episodes import tool_turn_ids
    recipe, items = tool_recipe(long_llama, chat_prompts(tmp_path), tmp_path, tools_file,
                                max_tool_calls=1)
    tok = recipe.tok
    scripted(monkeypatch, [SHOUT])["tok"] = tok
    # the prompt is the template's rendering with the tools' schemas
    user = items[0].row.prompt
    assert tok.decode(recipe.prompts[0].tokens).endswith(
        tok.apply_chat_template(user, add_generation_prompt=True, tools=recipe.box.schemas))
    assert "tools: shout hang boom via" in tok.decode(recipe.prompts[0].tokens)
    batch = recipe.make_batches(items, 1, 80, recipe.pad, shuffle=True, seed=0, epoch=0)[0]
    loss = recipe.step(batch.tokens[None], batch.positions[None], batch.labels[None],
                       hp_row(1, 1e-3), is_first=True)
    r = recipe.rollout
    assert list(r["tool_calls"]) == [1] * 4 and recipe.last_metrics["tools/calls_mean"] == 1
    # where the tool turn is in each row, found from the template's own rendering of the round
    prompt = recipe.prompts[int(r["prompts"][0])]
    fed = tool_turn_ids(tok, prompt.row.prompt, SHOUT, "HI!", recipe.box.schemas)
    assert "<tool_response>HI!</tool_response>" in tok.decode(fed)
    C, n = recipe.max_completion_length, len(prompt.tokens)
    call = len(tok.encode(SHOUT, add_bos=False))
    labels = r["labels"].reshape(4, C)
    mine = np.zeros((4, C), bool)   # the model's: the call, then after the tool turn to its stop
    for row in range(4):
        completion = r["tokens"][row, n:n + C]
        after = call + len(fed)
        assert list(completion[call:after]) == fed
        ends = [j for j in range(after, C) if completion[j] in recipe.stop_ids]
        mine[row, :call] = True
        mine[row, after:ends[0] + 1 if ends else C] = True
    mask = labels >= 0
    assert np.array_equal(mask, mine)
    # one update per rollout: the dapo loss is -sum(A * own tokens) / own tokens
    adv = r["advantages"][:, None]
    assert np.abs(adv).max() > 0
    want = -(token_weights(mine, "dapo", C) * adv).sum()
    assert loss == pytest.approx(want, abs=1e-6)
    every = mine.copy()   # (the same with the tool turns in: a loss the test tells apart)
    every[:, call:call + len(fed)] = True
    assert abs(-(token_weights(every, "dapo", C) * adv).sum() - want) > 1e-4
    recipe.box.close()


def test_a_broken_tool_is_a_reply_and_the_run_goes_on(long_llama, tmp_path, tools_file,
                                                      monkeypatch):
    from toygraph.recipes.tools import ToolBox
    recipe, items = tool_recipe(long_llama, chat_prompts(tmp_path), tmp_path, tools_file,
                                max_tool_calls=3)
    recipe.box.close()
    recipe.box = ToolBox(tools_file, timeout=0.25)
    calls = {'{"name": "hang", "arguments": {}}': "error: tool hang did not return within 0.25 s",
             '{"name": "boom", "arguments": {"x": 1}}': "error: tool boom raised ValueError: no no",
             '{nope': "error: tool call 1 is not JSON"}
    for call, reply in calls.items():
        monkeypatch.undo()   # the last call's script
        scripted(monkeypatch, [f"<tool_call>{call}</tool_call>"])["tok"] = recipe.tok
        rollout = recipe.make_rollout(np.array([0]), np.random.default_rng(0))
        for row in rollout["tokens"]:
            text = recipe.tok.decode(row)
            replies = re.findall(r"<tool_response>([^<]*)", text)   # (the budget may cut it)
            assert len(replies) == 1 and replies[0].startswith(reply), text
            assert len(replies[0]) < 600   # the exception's long text is cut
        assert list(rollout["tool_calls"]) == [1] * 4
    recipe.box.close()



#: Llama 3.x's layout (headers, an ipython role for tool replies, the assistant's text
#: trimmed, JSON calls with "parameters"), its end of turn the tiny vocabulary's <|im_end|>.
LLAMA3 = (
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n\"parameters\":' }}"
    "{%- for t in tools %}"
    "{{- ' ' + t.function.name }}{%- endfor %}{{- '<|im_end|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|im_end|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim"
    " + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")


def test_a_llama3_json_call_ends_its_turn_and_is_answered(tmp_path, tools_file, monkeypatch):
    from toygraph.data.prompts import encode_prompts, load_prompts
    (tmp_path / "llama3.jinja").write_text(LLAMA3)
    model = GGUFModel(write_tiny_llama(tmp_path / "tiny-384.gguf", n_ctx=384))   # long headers
    recipe = GRPO(rewards=[reward_file(tmp_path)], num_generations=2, max_completion_length=140,
                  tools=str(tools_file), max_tool_calls=2, template=str(tmp_path / "llama3.jinja"))
    recipe.realize(model, model.config, RecipeOptions(seq_len=144, batch=1, seed=3))
    assert recipe.style == "llama3" and recipe.call_ids == set(recipe.stop_ids)
    items = encode_prompts(load_prompts(chat_prompts(tmp_path)), recipe.tok, 144).items
    recipe.make_batches(items, 1, 144, recipe.pad, shuffle=False, seed=0, epoch=0)
    call = ' {"name": "shout", "parameters": {"text": "hi"}}<|im_end|>'   # trimmed by the template
    scripted(monkeypatch, [call], "assistant<|end_header_id|>\n\n",
             "ipython<|end_header_id|>")["tok"] = recipe.tok
    rollout = recipe.make_rollout(np.array([0]), np.random.default_rng(0))
    assert_answered(rollout, recipe.tok, 2, 140, call,
                    "<|start_header_id|>ipython<|end_header_id|>\n\nHI!<|im_end|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n", "ipython")
    recipe.box.close()


def assert_answered(rollout, tok, rows, C, call, reply, tag):
    """Each of ``rows`` episodes made ``call`` once and got ``reply`` (the template's tool turn
    and the next assistant header) right after it; its own labels hold the call, never the
    reply or its ``tag``."""
    assert list(rollout["tool_calls"]) == [1] * rows
    for r in range(rows):
        assert call + reply in tok.decode(rollout["tokens"][r])
        labels = rollout["labels"].reshape(rows, C)[r]
        own = tok.decode([int(x) for x in labels[labels >= 0]])
        assert own.startswith(call) and tag not in own and "HI!" not in own


def test_a_bare_json_call_ends_its_turn_when_the_style_says_so(long_llama, tmp_path, tools_file,
                                                                 monkeypatch):
    """--tool-call-style json over a Hermes template: the turn that is one JSON object (what
    Qwen2.5-Coder-0.5B writes instead of <tool_call> tags) is run at its end of turn."""
    recipe, items = tool_recipe(long_llama, chat_prompts(tmp_path), tmp_path, tools_file,
                                max_tool_calls=1, tool_call_style="json")
    assert recipe.style == "json" and recipe.call_ids == set(recipe.stop_ids)
    call = '{"name": "shout", "arguments": {"text": "hi"}}<|im_end|>'
    scripted(monkeypatch, [call])["tok"] = tok = recipe.tok
    rollout = recipe.make_rollout(np.array([0]), np.random.default_rng(0))
    assert_answered(rollout, tok, 4, recipe.max_completion_length, call,
                    "\n<|im_start|>user\n<tool_response>HI!</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n", "tool_response")
    recipe.box.close()


# --- an environment over turns --------------------------------------------------------------------
def guessing(monkeypatch, tok):
    """The sampler answers each turn with one digit (the one the real draw picks, mod 10)
    and ends it: a tiny random model neither writes numbers nor ends its turns."""
    real = batched.pick_token
    digits = [tok.encode(str(d), add_bos=False)[0] for d in range(10)]
    end = tok.token_to_id("<|im_end|>")

    def pick(logits, context, opts, rng):
        t = real(logits, context, opts, rng)
        turn = tok.decode(context).rsplit("<|im_start|>assistant\n", 1)[-1]
        return end if re.search(r"\d", turn) else digits[t % 10]

    monkeypatch.setattr(batched, "pick_token", pick)


#: A user's environment file (standard library only): guess a digit 1..9 drawn from the
#: prompt, told higher or lower; the right guess scores 1 and ends the episode.
SMALL_GAME = """import hashlib, re


class Small:
    def reset(self, prompt):
        self.secret = 1 + hashlib.sha256(prompt.encode()).digest()[0] % 9
        return prompt + ": guess my digit"

    def step(self, text):
        found = re.search(r"\\d", text)
        if found is None:
            return "a digit, please", 0.0, False
        guess = int(found.group())
        if guess == self.secret:
            return "right", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False
"""


def env_steps(out):
    return [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
            if e["event"] == "step"]


def test_an_environment_drives_turns_and_its_run_resumes_bit_for_bit(long_llama, tmp_path,
                                                                     monkeypatch):
    """3 steps straight == resumed from the step-2 checkpoint: each rollout's episodes
    (several turns, the guessing game answering each) are a function of the seed, the
    step and the weights, and the game's of the prompt and the guesses."""
    import shutil
    from toygraph.gguf.tokenizer import Tokenizer
    guessing(monkeypatch, Tokenizer.from_gguf(str(long_llama)))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"round {w}"}) + "\n" for w in WORDS))
    first = tmp_path / "first.py"   # a reward on the episode's first guess: 1 if it is >= 5
    first.write_text("def high(completions, **kw):\n"
                     "    return [float(c[0]['content'][:1] in '56789') for c in completions]\n")
    game = tmp_path / "game.py"   # the user's environment (its own process): 1..9, so some win
    game.write_text(SMALL_GAME)

    def config(out, **kw):
        return RunConfig(model=str(long_llama), data=str(data), out=str(out), recipe="grpo",
                         reward=(f"{first}:high",), reward_weights=("1", "2"),
                         environment=f"{game}:Small", steps=3, batch=1, num_generations=4,
                         seq_len=96, max_completion_length=60, val_split=0, lr=2e-2,
                         quiet=True, seed=3, **kw)

    run_training(config(tmp_path / "a", save_every=2))
    straight = env_steps(tmp_path / "a")
    assert all(e["environment/steps_mean"] > 1 for e in straight)   # several turns each
    assert any(e["grad_norm"] > 0 for e in straight)
    assert any(e["rewards/environment/mean"] > 0 for e in straight)   # a right guess
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "a", part)
    shutil.rmtree(part / "checkpoints" / "step-000003")
    run_training(config(part, save_every=2, resume=str(part / "checkpoints" / "step-000002")))
    same = ("loss", "reward", "grad_norm", "completions/mean_length", "environment/steps_mean",
            "rewards/environment/mean")
    resumed = env_steps(part)[-1:]
    assert [e["step"] for e in resumed] == [3]
    assert [[e[k] for k in same] for e in resumed] == [[e[k] for k in same] for e in straight[2:]]
    name = "adapter_model.safetensors"
    assert (part / name).read_bytes() == (tmp_path / "a" / name).read_bytes()


def test_an_environment_episode_feeds_its_observations_as_user_turns(long_llama, tmp_path,
                                                                    monkeypatch):
    from toygraph.data.prompts import encode_prompts, load_prompts
    from toygraph.recipes.environments import GuessingGame
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "round a"}) + "\n")
    model = GGUFModel(long_llama)
    recipe = GRPO(environment="guess", num_generations=2, max_completion_length=60)
    recipe.realize(model, model.config, RecipeOptions(seq_len=96, batch=1, seed=3))
    items = encode_prompts(load_prompts(data), recipe.tok, 96).items
    recipe.make_batches(items, 1, 96, recipe.pad, shuffle=False, seed=0, epoch=0)
    guessing(monkeypatch, recipe.tok)
    rollout = recipe.make_rollout(np.array([0]), np.random.default_rng(1))
    tok, C = recipe.tok, 60
    for r in range(2):
        text = tok.decode(rollout["tokens"][r])
        turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", text, re.DOTALL)
        # the game, played again on the same guesses, gives the same observations
        game = GuessingGame()
        assert turns[0] == ("user", game.reset("round a"))
        for (role, guess), (role2, observation) in zip(turns[1::2], turns[2::2]):
            assert role == "assistant" and role2 == "user"
            assert game.step(guess)[0].startswith(observation)   # the last may be cut
        # the labels are the model's guesses and ends of turn only
        labels = rollout["labels"].reshape(2, C)[r]
        own = tok.decode([int(x) for x in labels[labels >= 0]])
        assert re.fullmatch(r"(\d<\|im_end\|>)+\d?", own), own
        assert rollout["environment_steps"][r] == own.count("<|im_end|>")
    # validation: greedy episodes, the rows that only fill the sampler left out
    loss, n = recipe.evaluate(None, None, np.array([[0, 0]]))
    assert n == 1 and loss == -recipe.last_metrics["reward"]
    assert recipe.last_metrics["rewards/environment/mean"] in (0.0, 1.0)


def test_a_finetune_with_a_tools_file_completes(long_llama, tmp_path, tools_file, monkeypatch):
    """The options end to end: --tools and --template reach the rollouts."""
    from toygraph.gguf.tokenizer import Tokenizer
    (tmp_path / "hermes.jinja").write_text(TEMPLATE)
    scripted(monkeypatch, [SHOUT])["tok"] = Tokenizer.from_gguf(str(long_llama))
    out = tmp_path / "run"
    run_training(RunConfig(model=str(long_llama), data=str(chat_prompts(tmp_path)), out=str(out),
                           recipe="grpo", reward=(reward_file(tmp_path),), tools=str(tools_file),
                           max_tool_calls=1, template=str(tmp_path / "hermes.jinja"), steps=2,
                           batch=1, num_generations=2, seq_len=80, max_completion_length=140,
                           val_split=0, quiet=True, seed=3, log_completions=1))
    steps = env_steps(out)
    assert [e["tools/calls_mean"] for e in steps] == [1.0, 1.0]
    logged = steps[0]["sample"]   # the episode, its tool turn in it
    assert "tools: shout hang boom" in logged["prompt"]
    assert logged["completion"].startswith(SHOUT + "\nuser\n<tool_response>HI!</tool_response>")
    assert all(e["completions/mean_length"] < 140 - 40 for e in steps)   # the tool turns: not counted


def test_sampling_stops_on_the_closing_tag_however_it_is_spelled(tmp_path, long_llama):
    """A vocabulary with a </tool_call> token stops on it alone; one without stops on
    every token that can end the tag (and ToolRounds answers only a closed call)."""
    from toygraph.fixtures.tiny_vocab import write_vocab_gguf
    from toygraph.gguf.tokenizer import Tokenizer
    from toygraph.recipes.episodes import call_ids, call_style
    qwen3 = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "qwen3.gguf", "qwen3"))
    assert call_style(qwen3) == "hermes"
    assert call_ids(qwen3, "hermes") == {qwen3.token_to_id("</tool_call>")}
    tiny = Tokenizer.from_gguf(str(long_llama))
    assert tiny.token_to_id("</tool_call>") is None
    ids = call_ids(tiny, "hermes")
    for text in (SHOUT, "x</tool_call>", "</tool_call>", '{"a": "b>"}</tool_call>'):
        assert tiny.encode(text, add_bos=False)[-1] in ids
    assert tiny.encode("hello", add_bos=False)[-1] not in ids
