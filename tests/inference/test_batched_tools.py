"""Tool rounds in batched generation (generate_rows' call_ids / tool_turn / own): a row
that samples the call token is fed the tool turn's tokens through its cache, then samples
on as if the whole sequence had been its prompt; other rows are untouched; the forced
tokens are marked as not the model's, and an end-of-turn among them stops nothing."""
import numpy as np
import pytest

from toygraph.inference.batched import BatchedGenerator
from toygraph.inference.language_model import LanguageModel


@pytest.fixture(autouse=True)
def f32_products(monkeypatch):
    """Prefill and decode steps must round alike (as in test_kvcache.py)."""
    monkeypatch.setenv("TOYGRAPH_CPU_DOT", "f32")


PROMPTS = ["the cat sat on", "a dog and a cat and a bird went to the"]
NEW = 12


def generator(lm, prompts, prompt_len):
    return BatchedGenerator(lm.model, rows=len(prompts), prompt_len=prompt_len,
                            cache_len=prompt_len + NEW + 4)


def test_a_tool_turn_is_fed_through_the_cache_and_sampling_goes_on(tiny_llama):
    lm = LanguageModel(tiny_llama)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    plain = generator(lm, prompts, 24).generate(prompts, NEW)
    call = plain[0][0]                       # row 0's first greedy token plays the call tag
    eot = sorted(lm.stop_ids)[0]
    reply = [5, 9, eot, 14]                  # an end of turn inside the tool turn: no stop
    asked = []

    def tool_turn(r, so_far):
        asked.append((r, so_far))
        return reply if len(asked) == 1 else []

    own, trace, plain_trace = [], [], []
    generator(lm, prompts, 24).generate(prompts, NEW, trace=plain_trace)
    out = generator(lm, prompts, 24).generate(prompts, NEW, stop_ids=[eot], call_ids=[call],
                                              tool_turn=tool_turn, own=own, trace=trace)
    assert asked[0] == (0, plain[0][:1])
    assert out[0][:5] == plain[0][:1] + reply
    assert own[0][:5] == [True, False, False, False, False] and all(own[0][5:])
    assert len(out[0]) == NEW   # the forced end of turn stopped nothing
    # after the forced tokens the row continues as a fresh prompt of all of it would
    whole = prompts[0] + out[0][:5]
    fresh_trace = []
    fresh = generator(lm, [whole, prompts[1]], 24).generate([whole, prompts[1]], NEW - 5,
                                                           trace=fresh_trace)
    assert out[0][5:] == fresh[0]
    # the logits its 6th token was drawn from are those after the whole sequence ...
    np.testing.assert_allclose(trace[5][0], fresh_trace[0][0], rtol=1e-4, atol=1e-4)
    # ... and not those of the row that never saw the tool turn
    assert np.abs(trace[5][0] - plain_trace[5][0]).max() > 1e-2
    if call not in plain[1]:                 # row 1 never called: exactly as without tools
        assert out[1] == plain[1] and all(own[1])


def test_rows_without_a_tool_turn_are_unchanged(tiny_llama):
    lm = LanguageModel(tiny_llama)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    plain = generator(lm, prompts, 24).generate(prompts, NEW)
    own = []
    out = generator(lm, prompts, 24).generate(prompts, NEW, call_ids=[plain[0][0]],
                                              tool_turn=lambda r, so_far: [], own=own)
    assert out == plain and all(all(o) for o in own)
    assert np.array_equal([len(o) for o in own], [len(c) for c in out])
