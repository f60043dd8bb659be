"""Built-in environments for GRPO over turns (recipes/episodes.py): objects with
``reset(prompt) -> observation`` and ``step(text) -> (observation, reward, done)``, one
per episode. They need nothing installed.

>>> game = GuessingGame(high=100)
>>> game.reset("round 1").startswith("round 1")
True
"""
from __future__ import annotations

import hashlib
import re

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
