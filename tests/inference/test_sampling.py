"""Sampling filters checked against their definitions (and transformers' logits
processors where torch is present), streamed decoding, stop strings, seeds."""
import numpy as np
import pytest

from toygraph.errors import DataError
from toygraph.inference.language_model import LanguageModel
from toygraph.inference.sampling import (SamplingOptions, TextStream, apply_repetition_penalty,
                               min_p_filter, pick_token, softmax, top_k_filter, top_p_filter)
from toygraph.gguf.tokenizer import Tokenizer

PROBS = np.array([0.1, 0.5, 0.05, 0.2, 0.15])   # sorted: 0.5, 0.2, 0.15, 0.1, 0.05


def kept(z):
    return set(np.flatnonzero(np.isfinite(z)).tolist())


@pytest.mark.parametrize("p, want", [(0.45, {1}), (0.69, {1, 3}), (0.8, {1, 3, 4}),
                                     (0.94, {0, 1, 3, 4}), (0.96, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_p(p, want):
    assert kept(top_p_filter(np.log(PROBS), p)) == want


def test_top_p_definition_on_random_logits():
    rng = np.random.default_rng(0)
    for _ in range(200):
        z, p = rng.normal(size=50) * 3, rng.uniform(0.05, 0.99)
        probs, keep = softmax(z), sorted(kept(top_p_filter(z, p)), key=lambda i: -softmax(z)[i])
        dropped = set(range(50)) - set(keep)
        assert probs[keep].sum() >= p                      # the mass reaches p ...
        assert probs[keep[:-1]].sum() < p                  # ... and no smaller prefix does
        assert not dropped or probs[keep].min() >= probs[list(dropped)].max()  # most probable


def test_min_p_keeps_tokens_within_a_fraction_of_the_best():
    assert kept(min_p_filter(np.log(PROBS), 0.25)) == {1, 3, 4}      # >= 0.125
    assert kept(min_p_filter(np.log(PROBS), 0.0)) == {0, 1, 2, 3, 4}
    assert kept(min_p_filter(np.log(PROBS), 1.0)) == {1}


def test_top_k():
    assert kept(top_k_filter(np.log(PROBS), 2)) == {1, 3}
    assert kept(top_k_filter(np.log(PROBS), 0)) == {0, 1, 2, 3, 4}


def test_repetition_penalty_ctrl_convention():
    logits = np.array([2.0, -1.0, 0.5, -3.0, 1.0])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)   # repeats count once
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.5, -3.0, 1.0])
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [0, 3], 1.0), logits)


def test_filters_agree_with_transformers_processors():
    torch = pytest.importorskip("torch")
    gen = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(1)
    z = rng.normal(size=(1, 64)) * 2
    ctx = rng.integers(0, 64, size=(1, 10))
    zt, ct = torch.tensor(z), torch.tensor(ctx)
    ref = gen.RepetitionPenaltyLogitsProcessor(1.3)(ct, zt.clone()).numpy()[0]
    np.testing.assert_allclose(apply_repetition_penalty(z[0], ctx[0], 1.3), ref, rtol=1e-12)
    for mine, theirs in [(top_p_filter(z[0], 0.8), gen.TopPLogitsWarper(0.8)),
                         (min_p_filter(z[0], 0.1), gen.MinPLogitsWarper(0.1)),
                         (top_k_filter(z[0], 7), gen.TopKLogitsWarper(7))]:
        assert kept(mine) == kept(theirs(ct, zt.clone()).numpy()[0])


def test_pick_token_greedy_seeded_and_within_filters():
    rng = np.random.default_rng(2)
    z = rng.normal(size=100)
    greedy = SamplingOptions(temperature=0.0, top_k=5, top_p=0.3)
    assert all(pick_token(z, [], greedy, np.random.default_rng(s)) == int(np.argmax(z)) for s in range(5))
    # The penalty applies before greedy choice, as in transformers.
    z2 = z.copy()
    z2[7] = abs(z).max() + 0.1    # the best logit, positive: a penalty of 100 sinks it
    assert pick_token(z2, [], SamplingOptions(), None) == 7
    assert pick_token(z2, [7], SamplingOptions(repetition_penalty=100.0), None) != 7
    opts = SamplingOptions(temperature=1.5, top_k=10, seed=11)
    draws = [pick_token(z, [], opts, r) for r in (opts.rng(),) for _ in range(300)]
    again = [pick_token(z, [], opts, r) for r in (opts.rng(),) for _ in range(300)]
    assert draws == again                                      # the seed reproduces
    assert set(draws) <= set(np.argsort(-z)[:10].tolist())     # only top-k tokens drawn
    assert len(set(draws)) > 1                                 # and it does sample
    other = SamplingOptions(temperature=1.5, top_k=10, seed=12)
    assert [pick_token(z, [], other, r) for r in (other.rng(),) for _ in range(300)] != draws


@pytest.fixture(params=["engine", "numpy"])
def draw_path(request, monkeypatch):
    """sampling.draw through the CPU engine's tg_draw (the engine loaded) or numpy's steps."""
    from toygraph.cpu import engine
    if request.param == "engine":
        if engine.library() is None:
            pytest.skip("no host C++ compiler: no engine")
    else:
        monkeypatch.setattr(engine, "loaded", lambda: None)
    return request.param


def test_pick_token_draws_what_rng_choice_draws(draw_path):
    """pick_token's own draw (no checks of p) gives numpy's Generator.choice token for the
    same generator state, draw after draw, and leaves the generator where choice does; NaN
    logits are refused as choice refuses them. Both ways of drawing: the engine's and
    numpy's."""
    rng = np.random.default_rng(5)
    for V, opts in [(49152, SamplingOptions(temperature=1.0, seed=3)),
                    (1000, SamplingOptions(temperature=0.7, top_p=0.9, seed=4)),
                    (7, SamplingOptions(temperature=2.0, top_k=3, seed=5))]:
        z = rng.normal(size=V) * 3
        mine, theirs = opts.rng(), opts.rng()
        for _ in range(200):
            zz = min_p_filter(top_p_filter(top_k_filter(z / opts.temperature, opts.top_k),
                                           opts.top_p), opts.min_p)
            assert pick_token(z, [], opts, mine) == int(theirs.choice(V, p=softmax(zz)))
        assert mine.random() == theirs.random()
    with pytest.raises(ValueError, match="NaN"):
        pick_token(np.full(5, np.nan), [], SamplingOptions(temperature=1.0), np.random.default_rng(0))


def test_the_engines_draw_is_numpys_index_where_the_sums_are_close():
    """tg_draw against numpy's cumsum and searchsorted at the u that matter: each cdf value
    itself and its neighbours one ulp away (where a sum added in another order, or a
    division rounded otherwise, would move the index), with zeros, ties and a peaked p."""
    from toygraph.cpu import engine
    lib = engine.library()
    if lib is None:
        pytest.skip("no host C++ compiler: no engine")
    rng = np.random.default_rng(0)
    peaked = softmax(rng.normal(size=151936) * 12)
    flat = np.full(1000, 1e-3)
    zeros = rng.random(500) * (rng.random(500) < 0.3)
    for p in (peaked, flat, zeros / zeros.sum(), np.array([1.0]), np.array([0.0, 0.5, 0.0, 0.5])):
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        picks = rng.choice(cdf.size, size=min(cdf.size, 200), replace=False)
        for u in np.concatenate([cdf[picks], np.nextafter(cdf[picks], 0), np.nextafter(cdf[picks], 2),
                                 [0.0, np.nextafter(1.0, 0)]]):
            if u >= 1.0:
                continue
            assert lib.tg_draw(p.ctypes.data, p.size, float(u)) == cdf.searchsorted(u, side="right"), u
    assert lib.tg_draw(np.array([0.5, np.nan]).ctypes.data, 2, 0.3) == -1


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(min_p=2.0), dict(repetition_penalty=0.0), dict(top_k=-1),
                                 # not finite (issue 39): inf passed both checks
                                 dict(repetition_penalty=float("inf")), dict(temperature=float("inf")),
                                 dict(repetition_penalty=float("nan")), dict(top_p=float("nan"))])
def test_bad_options(bad):
    with pytest.raises(DataError, match="out of range"):
        SamplingOptions(**bad)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return Tokenizer.from_gguf(tiny_llama)


def stream_all(tok, ids, stops=()):
    s = TextStream(tok, stops)
    pieces = [s.push(i) for i in ids]
    pieces.append(s.finish())
    return s, [p for p in pieces if p]


def test_stream_never_splits_a_character(tok):
    text = "café ñandú — 東京 🙂 the end"
    ids = tok.encode(text, add_bos=False)
    assert len(ids) > len(text.split())        # multi-byte characters span several tokens
    s, pieces = stream_all(tok, ids)
    assert "".join(pieces) == s.text == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 3                     # it streamed, not one piece at the end


def test_stream_stops_at_stop_string_and_trims_it(tok):
    ids = tok.encode("the cat sat on the mat and more", add_bos=False)
    s, pieces = stream_all(tok, ids, stops=["on the", "zzz"])
    assert s.stopped and s.text == "the cat sat " and "".join(pieces) == s.text
    s, pieces = stream_all(tok, ids, stops=["mat and more!"])   # a prefix held back, then released
    assert not s.stopped and "".join(pieces) == "the cat sat on the mat and more"


def test_generate_streams_and_stops(tiny_llama):
    lm = LanguageModel(tiny_llama)
    full = lm.generate("the cat", max_new_tokens=24)
    pieces = []
    again = lm.generate("the cat", max_new_tokens=24, on_text=pieces.append)
    assert again == full and "".join(pieces) == full and len([p for p in pieces if p]) > 1
    stop = full[4:7]
    assert len(full) > 8 and stop.strip()
    cut = lm.generate("the cat", max_new_tokens=24, stop=[stop])
    assert cut == full[:full.find(stop)]
    short = lm.generate("the cat", max_new_tokens=3)
    assert len(lm.tokenizer.encode(short, add_bos=False)) <= 3 and full.startswith(short)
    a = lm.generate("the cat", max_new_tokens=12, temperature=1.0, top_p=0.9, min_p=0.05,
                    repetition_penalty=1.2, seed=5)
    b = lm.generate("the cat", max_new_tokens=12, temperature=1.0, top_p=0.9, min_p=0.05,
                    repetition_penalty=1.2, seed=5)
    assert a == b


def test_cli_generate_prints_the_streamed_text(tiny_llama, capsys):
    from toygraph.cli import main
    lm = LanguageModel(tiny_llama)
    full = lm.generate("the cat", max_new_tokens=16)
    stop = full[5:8]
    want = lm.generate("the cat", max_new_tokens=16, stop=[stop], top_k=3)  # greedy: top_k unused
    assert want == full[:full.find(stop)]
    assert main(["generate", "--model", str(tiny_llama), "--prompt", "the cat", "--top-k", "3",
                 "--max-new-tokens", "16", "--stop", stop]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", "--model", str(tiny_llama), "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p must be a number in (0, 1] (1 = off), got 0.0" in capsys.readouterr().err
