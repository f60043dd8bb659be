"""Episodes over turns (recipes/episodes.py): tool rounds, environments, and a loss that
covers only the model's own turns."""
from pathlib import Path

import numpy as np
import pytest

from toygraph.data.encoding import encode_rows
from toygraph.inference.language_model import LanguageModel
from toygraph.recipes.environments import GuessingGame
from toygraph.recipes.episodes import (environment_episode, episode_example, model_generate,
                                       tool_episode)
from toygraph.recipes.tools import ToolBox

TOOLS = '''
import time


def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


def hang() -> str:
    """Never returns in time."""
    time.sleep(60)
    return ""
'''

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
USER = [{"role": "user", "content": "shout zebra"}]
CALL = '<tool_call>\n{"name": "shout", "arguments": {"text": "zebra"}}\n'   # cut at the tag


class Scripted:
    """A model that says the given turns in order, and remembers what it was shown."""

    def __init__(self, *turns):
        self.turns, self.seen = list(turns), []

    def __call__(self, messages, stop):
        self.seen.append(([dict(m) for m in messages], tuple(stop)))
        return self.turns.pop(0)


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    b = ToolBox(path, timeout=1.0)
    yield b
    b.close()


def test_a_call_gets_its_reply_as_a_tool_turn_and_the_model_goes_on(box):
    model = Scripted(CALL, "It is ZEBRA.")
    ep = tool_episode(model, box, USER, "qwen", max_tool_calls=3)
    assert ep.messages == USER + [
        {"role": "assistant", "content": CALL + "</tool_call>"},   # the tag it stopped on
        {"role": "tool", "content": "ZEBRA", "name": "shout"},
        {"role": "assistant", "content": "It is ZEBRA."}]
    assert (ep.tool_calls, ep.done) == (1, True)
    assert model.seen[0] == (USER, ("</tool_call>",))
    assert model.seen[1][0] == ep.messages[:3]   # the second turn sees the tool's reply


def test_tool_rounds_stop_at_max_tool_calls(box):
    model = Scripted(CALL, CALL, CALL, CALL)
    ep = tool_episode(model, box, USER, "qwen", max_tool_calls=2)
    assert ep.tool_calls == 2 and not ep.done
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant",
                                                "tool", "assistant"]
    assert len(model.turns) == 1   # three model turns: two answered, the last one not


def test_a_broken_call_is_a_reply_the_episode_goes_on_from(box):
    hang = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    bad = '<tool_call>{"name": "shout", "arguments": {text: 1}}</tool_call>'
    ep = tool_episode(Scripted(hang, bad, "done"), box, USER, "hermes", max_tool_calls=5)
    replies = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert replies[0].startswith("error: tool hang did not return within 1 s")
    assert replies[1].startswith("error: tool call 1 is not JSON")
    assert ep.messages[-1] == {"role": "assistant", "content": "done"} and ep.done


def test_tool_turns_carry_no_loss(box, tiny_llama):
    """The encoded episode's targets are the assistant turns' tokens; the tool's reply
    (ZEBRA, which no assistant turn says) is in the row but never a target."""
    tok = LanguageModel(tiny_llama).tokenizer
    tok.use_template(str(TEMPLATES / "qwen2_5.jinja"))   # tool-aware: tool turns as Qwen's
    ep = tool_episode(Scripted(CALL, "It is loud."), box, USER, "qwen", max_tool_calls=1)
    [row] = encode_rows(episode_example(ep, box.schemas), tok, 512)
    tokens, mask = np.asarray(row.tokens), np.asarray(row.target_mask, bool)
    assert "ZEBRA" in tok.decode(tokens.tolist())
    targets = tok.decode(tokens[mask].tolist())
    assert "ZEBRA" not in targets
    assert "It is loud." in targets and '"name": "shout"' in targets


def bisect(messages, stop):
    """A player that halves the range by the game's answers."""
    lo, hi = 1, 100
    guess = None
    for m in messages:
        if m["role"] == "assistant":
            guess = int(m["content"])
        elif guess is not None and m["content"] in ("higher", "lower"):
            lo, hi = (guess + 1, hi) if m["content"] == "higher" else (lo, guess - 1)
    return str((lo + hi) // 2)


def test_an_environment_drives_turns_and_replays_exactly():
    ep = environment_episode(bisect, GuessingGame(100), "round 7", max_turns=10)
    assert ep.done and ep.rewards[-1] == 1.0 and ep.reward == 1.0
    assert ep.messages[-1]["role"] == "assistant"
    secret = int(ep.messages[-1]["content"])
    assert all(m["content"] in ("higher", "lower") for m in ep.messages[2::2])
    again = environment_episode(bisect, GuessingGame(100), "round 7", max_turns=10)
    assert again.messages == ep.messages and again.rewards == ep.rewards
    game = GuessingGame(100)
    game.reset("round 7")
    assert game.secret == secret


def test_an_environment_episode_ends_at_max_turns():
    ep = environment_episode(lambda m, s: "no idea", GuessingGame(100), "p", max_turns=3)
    assert not ep.done and ep.rewards == [0.0, 0.0, 0.0]
    assert ep.messages[2]["content"] == "Answer with one number from 1 to 100."


def test_model_generate_runs_a_real_model_through_an_episode(box, tiny_llama):
    lm = LanguageModel(tiny_llama)
    generate = model_generate(lm, tools=box.schemas, max_new_tokens=6)
    ep = tool_episode(generate, box, USER, "qwen", max_tool_calls=1)
    said = lm.generate(USER, chat=True, max_new_tokens=6, stop=["</tool_call>"])
    assert ep.messages[1]["content"].startswith(said)   # greedy: the same first turn


ENV = '''
import time


class Counter:
    """Counts the turns; done when the model says stop."""

    def __init__(self):
        self.turns = 0

    def reset(self, prompt):
        self.turns = 0
        return f"count with me: {prompt}"

    def step(self, text):
        self.turns += 1
        if text == "boom":
            raise ValueError("no\\nboom")
        if text == "hang":
            time.sleep(60)
        if text == "shape":
            return "only", 1.0
        if text == "nan":
            return "x", float("nan"), False
        return f"turn {self.turns}", 0.5, text == "stop"
'''


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    from toygraph.recipes.environments import environments
    path = tmp_path_factory.mktemp("env") / "env.py"
    path.write_text(ENV)
    return lambda: environments(f"{path}:Counter", timeout=1.0)


def test_a_user_environment_runs_in_its_own_process_one_object_per_episode(counter):
    envs = counter()
    a, b = envs.new(), envs.new()
    ep = environment_episode(Scripted("one", "two", "stop"), a, "go", max_turns=5)
    assert [m["content"] for m in ep.messages] == ["count with me: go", "one", "turn 1", "two",
                                                  "turn 2", "stop"]
    assert ep.rewards == [0.5, 0.5, 0.5] and ep.done
    b.reset("other")
    assert b.step("x") == ("turn 1", 0.5, False)   # its own count, not a's
    envs.close()


@pytest.mark.parametrize("turn, error", [
    ("boom", "environment .*env.py:Counter failed in step: ValueError: no boom$"),
    ("hang", "environment .*env.py:Counter did not return within 1 s .the environments' time "
             "limit.; its process was stopped"),
    ("shape", r"step returned \('only', 1.0\); expected \(observation, reward, done\)"),
    ("nan", "step's reward is nan; expected a finite number"),
])
def test_an_environment_that_misbehaves_is_a_one_line_error(counter, turn, error):
    from toygraph.recipes.rewards import RewardError
    envs = counter()
    env = envs.new()
    env.reset("p")
    with pytest.raises(RewardError, match=error) as e:
        env.step(turn)
    assert "\n" not in str(e.value)
    envs.close()


def test_environment_specs_that_cannot_load_are_one_line_errors(tmp_path):
    from toygraph.recipes.environments import environments
    from toygraph.recipes.rewards import RewardError
    with pytest.raises(RewardError, match="expected module:Factory"):
        environments("nonsense")
    with pytest.raises(RewardError, match=r"cannot import it \(FileNotFoundError"):
        environments(f"{tmp_path / 'none.py'}:Game")
    g = environments("guess").new()
    assert g.reset("p").startswith("p\nI am thinking")


def qwen_tokenizer(tiny_llama):
    tok = LanguageModel(tiny_llama).tokenizer
    tok.use_template(str(TEMPLATES / "qwen2_5.jinja"))
    return tok


def test_a_tool_turn_is_the_templates_own_rendering_of_the_round(box, tiny_llama):
    from toygraph.recipes.episodes import tool_turn_ids
    tok = qwen_tokenizer(tiny_llama)
    call = CALL + "</tool_call>"
    ids = tool_turn_ids(tok, USER, call, "ZEBRA", box.schemas)
    assert tok.decode(ids) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nZEBRA\n"
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the prompt, the model's call and these ids are the template's rendering of it all
    whole = tok.apply_chat_template(USER + [{"role": "assistant", "content": call},
                                            {"role": "tool", "content": "ZEBRA"}],
                                    add_generation_prompt=True, tools=box.schemas)
    before = tok.apply_chat_template(USER, add_generation_prompt=True, tools=box.schemas)
    assert before + call + tok.decode(ids) == whole


def test_an_episode_whose_tokens_ran_out_after_a_tool_reply_ends_in_an_empty_model_turn(
        box, tiny_llama):
    """Cut right after the tool turn was fed, the episode's last turn is the model's, empty:
    a reward reading the last turn must not take the tool's reply for the model's answer
    (bench/grpo_calculator.py's first run learned exactly that: to end on the reply)."""
    from toygraph.recipes.episodes import ToolRounds
    tok = qwen_tokenizer(tiny_llama)
    rounds = ToolRounds(tok, box, "qwen", [USER], max_tool_calls=2)
    said = tok.encode(CALL + "</tool_call>", add_bos=False)
    fed = rounds(0, said)
    turns = rounds.completion_messages(0, said + fed)   # no token of the model's after it
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
    assert turns[-1]["content"] == "" and turns[-2]["content"] == "ZEBRA"
    answer = tok.encode("It is ZEBRA.", add_bos=False)
    assert rounds.completion_messages(0, said + fed + answer)[-1] == \
        {"role": "assistant", "content": "It is ZEBRA."}
    assert rounds.completion_messages(0, said)[-1]["role"] == "assistant"   # before any round


def test_tool_rounds_answer_each_closed_call_once_and_stop_at_the_limit(box, tiny_llama):
    from toygraph.recipes.episodes import ToolRounds
    tok = qwen_tokenizer(tiny_llama)
    rounds = ToolRounds(tok, box, "qwen", [USER, USER], max_tool_calls=1)
    said = tok.encode(CALL + "</tool_call>", add_bos=False)
    fed = rounds(0, said)
    assert "ZEBRA" in tok.decode(fed) and rounds.calls == [1, 0]
    assert rounds.messages[0][-1] == {"role": "tool", "content": "ZEBRA"}
    # the row's next call is over its limit; the other row's first is answered
    assert rounds(0, said + fed + said) == []
    assert rounds(1, tok.encode("no call here", add_bos=False)) == []
    assert "ZEBRA" in tok.decode(rounds(1, said))
