"""A reward of bench/grpo_capitals.py, with TRL's signature (``--reward
bench/grpo_capitals_rewards.py:names_capital``): 1 when the completion names the right
capital anywhere, in any form, 0 otherwise. Partial credit that a 135M model earns from
its first samples (``exact:capital`` and the JSON rewards it does not: none of its
sampled answers is JSON at first), so its groups are not all equal."""
from toygraph.recipes.rewards import completion_text, normalise


def names_capital(prompts, completions, capital, **fields):
    return [float(normalise(c) in normalise(completion_text(x)))
            for x, c in zip(completions, capital)]
