"""Batched generation (toygraph/inference/batched.py): every row's greedy tokens equal
one-row generation's (kvcache.py) for prompts of different lengths, for every family
(sliding windows, q/k norms, rope factors), with an adapter, on numpy and on the CUDA
kernels (host executor); a seed reproduces sampled completions; rows stop at their own
end-of-turn token. Gemma 4, Qwen3.5 and the MoE families are checked in their own
modules (test_gemma4.py, test_qwen35.py, test_moe_models.py) against the same helper."""

import numpy as np
import pytest

from test_kvcache import (LOGIT_TOL, WRITERS, f32_products, greedy_steps,  # noqa: F401
                          normwise, random_adapter)
from toygraph.errors import DataError
from toygraph.inference.batched import BatchedGenerator
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
