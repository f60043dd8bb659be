"""Batched generation (toygraph/inference/batched.py): every row's greedy tokens equal
one-row generation's (kvcache.py) for prompts of different lengths, for every family
(sliding windows, q/k norms, rope factors), with an adapter, on numpy and on the CUDA
kernels (host executor); a seed reproduces sampled completions; rows stop at their own
end-of-turn token. A prefill over fewer prompt rows than rows (one per distinct prompt)
gives the same tokens as one per row and as one-row generation, and a wrong row map is
caught by that comparison. Gemma 4, Qwen3.5 and the MoE families are checked in their own
modules (test_gemma4.py, test_qwen35.py, test_moe_models.py) against the same helpers."""

import numpy as np
import pytest

from test_kvcache import (LOGIT_TOL, WRITERS, f32_products, greedy_steps,  # noqa: F401
                          normwise, random_adapter)
from toygraph.core.session import Session
from toygraph.errors import DataError
from toygraph.inference.batched import BatchedGenerator, distinct_prompts
from toygraph.inference.language_model import LanguageModel
from toygraph.inference.sampling import SamplingOptions

PROMPTS = ["the cat sat on", "a dog and a cat and a bird and a dog went to the river and",
           "a bird", "a bird and a dog and a cat and a dog went to the sea and then the"]
NEW = 12


@pytest.fixture(scope="module")
def models(tiny_dir, tiny_llama, tiny_qwen2):
    out = {"llama": tiny_llama, "qwen2": tiny_qwen2}
    for name, write in WRITERS.items():
        path = tiny_dir / f"kv-{name}.gguf"
        out[name] = path if path.exists() else write(path)
    return out


def _prompts(lm):
    return [lm.tokenizer.encode(p) for p in PROMPTS]


def _batched(lm, prompts, backend="cpu", new=NEW, **kw):
    P = max(map(len, prompts)) + 3          # padding after every prompt
    return BatchedGenerator(lm.model, rows=len(prompts), prompt_len=P, cache_len=P + new + 5,
                            backend=backend, lora=lm.lora_config, adapter=lm.adapter, **kw)


def assert_rows_are_one_row_generation(lm, new=NEW, texts=PROMPTS, tol=LOGIT_TOL):
    """Each row's greedy tokens (and the logits they came from) are one-row generation's,
    for prompts of different lengths; returns the rows."""
    prompts = [lm.tokenizer.encode(p) for p in texts]
    assert len(set(map(len, prompts))) == len(prompts)
    trace = []
    got = _batched(lm, prompts, new=new).generate(prompts, new, trace=trace)
    for r, (ids, row) in enumerate(zip(prompts, got)):
        tokens, logits = greedy_steps(lm, ids, new, kv_cache=True)
        assert row == tokens
        assert normwise(np.array([t[r] for t in trace]), logits) <= tol
    return got


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "llama3"])
def test_each_row_is_one_row_generation_at_temperature_0(models, family):
    assert_rows_are_one_row_generation(LanguageModel(models[family]))


def test_with_an_adapter(models, tmp_path):
    path = models["llama"]
    lm = LanguageModel(path, adapter_dir=random_adapter(path, tmp_path / "ad"))
    prompts = _prompts(lm)
    got = _batched(lm, prompts).generate(prompts, NEW)
    plain = _batched(LanguageModel(path), prompts).generate(prompts, NEW)
    assert got != plain                                  # the adapter changes the tokens
    for ids, row in zip(prompts, got):
        assert row == greedy_steps(lm, ids, NEW, kv_cache=True)[0]


def test_on_the_cuda_kernels(models, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    lm = LanguageModel(models["gemma3"])
    prompts = _prompts(lm)[:3]
    want = _batched(lm, prompts).generate(prompts, 6)
    assert _batched(lm, prompts, backend="cuda").generate(prompts, 6) == want


def test_a_seed_reproduces_sampled_completions(models):
    lm = LanguageModel(models["llama"])
    prompts = _prompts(lm)
    gen = _batched(lm, prompts)
    opts = SamplingOptions(temperature=1.0, top_p=0.95)
    a = gen.generate(prompts, NEW, opts, np.random.default_rng(7))
    b = gen.generate(prompts, NEW, opts, np.random.default_rng(7))
    c = gen.generate(prompts, NEW, opts, np.random.default_rng(8))
    assert a == b and a != c


def test_rows_stop_at_their_own_stop_token(models):
    lm = LanguageModel(models["llama"])
    prompts = _prompts(lm)
    gen = _batched(lm, prompts)
    free = gen.generate(prompts, NEW)
    stop = free[1][2]                       # row 1's third token ends row 1 (and any other)
    got = gen.generate(prompts, NEW, stop_ids=[stop])
    for row, full in zip(got, free):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:cut]
    assert len(got[1]) <= 3


def test_bad_requests_are_one_line_errors(models):
    lm = LanguageModel(models["llama"])
    prompts = _prompts(lm)
    gen = _batched(lm, prompts)
    with pytest.raises(DataError, match="3 prompts for 4 rows"):
        gen.generate(prompts[:3], 4)
    with pytest.raises(DataError, match="max_new_tokens must be in"):
        gen.generate(prompts, 1000)
    with pytest.raises(DataError, match="prompts must have 1 to"):
        gen.generate([[]] + prompts[1:], 4)


# --- one prefill per distinct prompt --------------------------------------------------------
#: Six rows sampling three prompts of different lengths (PROMPTS[0], [1], [2]), a prompt's
#: rows apart, so a map that ignores the order gives a row another prompt's cache.
SHARED = [0, 1, 0, 2, 1, 0]


def assert_shared_prefill_is_each_rows_own(lm, new=NEW, tol=LOGIT_TOL, texts=PROMPTS):
    """A prefill over U = 3 prompt rows (and U = 4: one prompt row unused) for the SHARED
    rows: the greedy tokens equal the prefill over all rows' (U == R) and one-row
    generation's, the logits they came from within ``tol`` of both."""
    prompts = [lm.tokenizer.encode(texts[i]) for i in SHARED]
    want_trace = []
    want = _batched(lm, prompts, new=new).generate(prompts, new, trace=want_trace)
    for U in (3, 4):
        trace = []
        got = _batched(lm, prompts, new=new, prompt_rows=U).generate(prompts, new, trace=trace)
        assert got == want, U
        assert normwise(np.array(trace), np.array(want_trace)) <= tol
    for r, ids in enumerate(prompts):
        tokens, logits = greedy_steps(lm, ids, new, kv_cache=True)
        assert got[r] == tokens
        assert normwise(np.array([t[r] for t in trace]), logits) <= tol
    return got


def test_distinct_prompts_map_each_row_to_its_prompt():
    distinct, rows = distinct_prompts([[5, 6], [7], [5, 6], [7, 8], [7]])
    assert distinct == [[5, 6], [7], [7, 8]] and rows.tolist() == [0, 1, 0, 2, 1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "llama3"])
def test_a_shared_prefill_gives_each_row_its_own_tokens(models, family):
    assert_shared_prefill_is_each_rows_own(LanguageModel(models[family]))


def test_a_shared_prefill_with_an_adapter(models, tmp_path):
    path = models["llama"]
    assert_shared_prefill_is_each_rows_own(
        LanguageModel(path, adapter_dir=random_adapter(path, tmp_path / "ad")))


def test_a_shared_prefill_samples_what_one_per_row_samples(models):
    """Seeded sampling: the same tokens from the same generator, a group of 4 rows per
    prompt (GRPO's layout) on a prefill of 2 prompt rows."""
    lm = LanguageModel(models["llama"])
    prompts = [lm.tokenizer.encode(PROMPTS[i]) for i in (0, 0, 0, 0, 3, 3, 3, 3)]
    opts = SamplingOptions(temperature=1.0, top_p=0.95)
    want = _batched(lm, prompts).generate(prompts, NEW, opts, np.random.default_rng(7))
    gen = _batched(lm, prompts, prompt_rows=2)
    assert gen.generate(prompts, NEW, opts, np.random.default_rng(7)) == want
    assert len({tuple(row) for row in want}) > 2     # the group's rows drew apart


def test_a_wrong_map_is_caught(models, monkeypatch):
    """The map uploaded rolled by one row (the first logits still the right prompt's):
    the rows read other prompts' caches, and the comparison fails."""
    upload = Session.upload

    def rolled(sess, tensor, value):
        if getattr(tensor, "name", "").endswith(".map"):
            value = np.roll(value, 1)
        upload(sess, tensor, value)

    monkeypatch.setattr(Session, "upload", rolled)
    with pytest.raises(AssertionError):
        assert_shared_prefill_is_each_rows_own(LanguageModel(models["llama"]))


def test_more_distinct_prompts_than_prompt_rows(models):
    """A one-line DataError; with a prefill over every row too (GRPO's evaluation), that
    one runs, and requests that fit the small one run it."""
    lm = LanguageModel(models["llama"])
    prompts = _prompts(lm)
    with pytest.raises(DataError, match="4 distinct prompts, but the prefill has 2 prompt rows"):
        _batched(lm, prompts, prompt_rows=2).generate(prompts, 4)
    both = _batched(lm, prompts, prompt_rows=(2, 4))
    assert both.generate(prompts, 4) == _batched(lm, prompts).generate(prompts, 4)
    assert {key for _, key in both.gen.programs} == {4, 0}       # the prefill over 4 rows
    pair = [prompts[0], prompts[1]] * 2
    assert both.generate(pair, 4) == _batched(lm, pair).generate(pair, 4)
    assert {key for _, key in both.gen.programs} == {2, 4, 0}
    for bad in (0, 5, ()):
        with pytest.raises(DataError, match="prompt_rows must be in"):
            _batched(lm, prompts, prompt_rows=bad)


def test_a_shared_prefill_on_the_cuda_kernels(models, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    lm = LanguageModel(models["gemma3"])
    prompts = [lm.tokenizer.encode(PROMPTS[i]) for i in (0, 2, 0)]
    want = _batched(lm, prompts).generate(prompts, 6)
    assert _batched(lm, prompts, backend="cuda", prompt_rows=2).generate(prompts, 6) == want
