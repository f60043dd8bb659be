"""Environments for GRPO over turns (recipes/episodes.py): objects with
``reset(prompt) -> observation`` and ``step(text) -> (observation, reward, done)``, one
per episode, made by a factory (a class, or any callable of no arguments).

>>> game = GuessingGame(high=100)
>>> game.reset("round 1").startswith("round 1")
True
>>> envs = environments("env.py:Factory", timeout=30)                # doctest: +SKIP
>>> env = envs.new(); env.reset("prompt"); env.step("text")           # doctest: +SKIP

``environments(spec)``: ``guess`` is the built-in GuessingGame (it needs nothing
installed and runs in the run's process); ``module:Factory`` or ``path/env.py:Factory`` is
the user's code, run in a process of its own as the Python rewards are
(recipes/reward_worker.py), each method call bounded by ``timeout`` seconds. What an
environment does wrong -- raises, exits, forks, overruns its time, returns something that
is not ``(observation, reward, done)`` with a finite reward -- is a one-line RewardError
naming it.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import re

from toygraph.recipes.rewards import RewardError, RewardWorker

_NUMBER = re.compile(r"-?\d+")


class GuessingGame:
    """Guess a whole number in 1..``high``. The number is drawn from the prompt's text (its
    sha256), so an episode over the same prompt and the same replies is the same episode,
    run after run and on resume. Each turn's first number is the guess, answered
    "higher", "lower" or "right"; the right guess scores 1 and ends the episode, any other
    turn scores 0 (a turn with no number is told how to answer)."""

    def __init__(self, high: int = 100):
        if high < 2:
            raise ValueError(f"GuessingGame: high must be >= 2, got {high}")
        self.high, self.secret, self.guesses = high, None, 0

    def reset(self, prompt) -> str:
        text = prompt if isinstance(prompt, str) else repr(prompt)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        self.secret = 1 + int.from_bytes(digest[:8], "little") % self.high
        self.guesses = 0
        return (f"{text}\nI am thinking of a whole number from 1 to {self.high}. Guess it: "
                f"answer with one number.")

    def step(self, text: str) -> tuple[str, float, bool]:
        if self.secret is None:
            raise RuntimeError("GuessingGame.step before reset")
        found = _NUMBER.search(text)
        if found is None:
            return f"Answer with one number from 1 to {self.high}.", 0.0, False
        guess = int(found.group())
        self.guesses += 1
        if guess == self.secret:
            return f"Right: {guess}, in {self.guesses} guesses.", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


#: Built-in environments by name.
BUILT_IN = {"guess": GuessingGame}


def environments(spec: str, timeout: float = 30.0):
    """The factory of ``spec``'s environments: ``.new()`` makes one per episode."""
    if spec in BUILT_IN:
        return _Local(BUILT_IN[spec], spec)
    module, colon, name = spec.rpartition(":")
    if not colon or not module or not name.isidentifier():
        raise RewardError(f"--environment {spec!r}: expected module:Factory, "
                          f"path/env.py:Factory or one of {', '.join(BUILT_IN)}")
    return EnvironmentWorker(spec, module, name, timeout)


class _Local:
    """A built-in environment's factory, in the run's own process."""

    def __init__(self, factory, spec: str):
        self.factory, self.spec = factory, spec

    def new(self):
        return _Checked(self.factory(), self.spec)

    def close(self) -> None:
        pass


class _Checked:
    """An environment whose answers are checked (``step``'s shape, a finite reward)."""

    def __init__(self, env, spec: str):
        self.env, self.spec = env, spec

    def reset(self, prompt) -> str:
        return str(self.env.reset(prompt))

    def step(self, text: str) -> tuple[str, float, bool]:
        return checked_step(self.env.step(text), self.spec)

    def close(self) -> None:
        pass


def checked_step(result, spec: str) -> tuple[str, float, bool]:
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise RewardError(f"environment {spec}: step returned {_shown(result)}; expected "
                          f"(observation, reward, done)")
    observation, reward, done = result
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
            or not math.isfinite(reward):
        raise RewardError(f"environment {spec}: step's reward is {_shown(reward)}; expected a "
                          f"finite number")
    return str(observation), float(reward), bool(done)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class EnvironmentWorker(RewardWorker):
    """The user's environments, in RewardWorker's process, with its time limit."""
    timeout_flag, process = "the environments' time limit", "the process environments run in"

    def __init__(self, spec: str, module: str, name: str, timeout: float):
        self.specs, self.timeout, self.spec = [spec], float(timeout), spec
        self._start(f"--environment {spec}: cannot start the process environments run in")
        answer = self._ask(("environment", module, name), f"--environment {spec}")
        if answer[0] != "ok":
            self._stop()
            raise RewardError(f"--environment {spec}: cannot import it ({answer[1]}: "
                              f"{answer[2]})")
        self._keys = itertools.count()

    def new(self) -> "_Remote":
        key = next(self._keys)
        self._result(self._ask(("new", key), f"environment {self.spec}"), "making one")
        return _Remote(self, key)

    def _result(self, answer: tuple, what: str):
        if answer[0] == "ok":
            return answer[1]
        self._stop()   # the environments' state is unknown from here on: the run stops
        name = f"environment {self.spec}"
        if answer[0] == "raised":
            raise RewardError(f"{name} failed {what}: {answer[1]}: {answer[2]}")
        if answer[0] == "exit":
            raise RewardError(f"{name} called sys.exit({answer[1]!r}) {what}")
        if answer[0] == "fork":
            raise RewardError(f"{name} called os.fork() {what}; environments must not fork")
        raise RewardError(f"{name} returned a value that cannot be passed back {what}: "
                          f"{answer[1]}")

    def close(self) -> None:
        self._stop()


class _Remote:
    """One environment object living in the worker."""

    def __init__(self, worker: EnvironmentWorker, key: int):
        self.worker, self.key = worker, key

    def _method(self, name: str, *args):
        w = self.worker
        return w._result(w._ask(("method", self.key, name, args), f"environment {w.spec}"),
                         f"in {name}")

    def reset(self, prompt) -> str:
        return str(self._method("reset", prompt))

    def step(self, text: str) -> tuple[str, float, bool]:
        return checked_step(self._method("step", text), self.worker.spec)

    def close(self) -> None:
        """Let the worker drop the object (an episode's end); nothing if it is gone."""
        w = self.worker
        if w._stop.alive:
            w._ask(("drop", self.key), f"environment {w.spec}")
