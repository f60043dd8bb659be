"""Sample packing (toygraph/data/packing.py): the first-fit-decreasing packer, packed batches,
and the model-level promise: a packed batch gives every example the loss it has alone and
the same total gradient as the unpacked batch, and no example sees another's tokens, for
every architecture the decoder builder has."""
import numpy as np
import pytest

from toygraph.data.batches import Encoded, batches
from toygraph.errors import DataError, GraphError
from toygraph.fixtures import tiny_models
from toygraph.models.model import GGUFModel
from toygraph.core.graph import Graph
from toygraph.models.decoder import BuildOptions, WeightSource, build_decoder
from toygraph.data.packing import (batches_per_epoch, epoch_batches, first_fit_decreasing,
                                   labelled_share, packed_batches, packing_efficiency)
from toygraph.recipes import LoRA, RecipeOptions
from toygraph.core.session import Session


def naive_ffd(sizes, capacity):
    """First-fit decreasing written the obvious way, as the reference."""
    rows, room = [], []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for r in range(len(rows)):
            if room[r] >= sizes[i]:
                rows[r].append(i)
                room[r] -= sizes[i]
                break
        else:
            rows.append([i])
            room.append(capacity - sizes[i])
    return rows


def make_items(rng, n, max_len, vocab=50):
    """Encoded examples of 2..max_len tokens with a prompt part that is not a target."""
    items = []
    for line in range(n):
        length = int(rng.integers(2, max_len + 1))
        mask = [False] * int(rng.integers(1, length)) if length > 1 else [False]
        mask += [True] * (length - len(mask))
        items.append(Encoded(rng.integers(3, vocab, size=length).tolist(), mask, False, line + 1))
    return items


def test_an_epoch_holds_its_order_not_its_arrays():
    """An epoch's batches were built whole: 10^6 short rows at --seq-len 128 held 1.5 GB of
    padded tokens, labels and positions before step 1. Now each batch is made when it is
    read, with the same values (the eager arrays of the same order, row for row)."""
    import tracemalloc
    rng = np.random.default_rng(0)
    items = [Encoded(rng.integers(0, 50, n).astype(np.int32), rng.random(n) > 0.5, False, i + 1)
             for i, n in enumerate(rng.integers(2, 9, 20_000))]
    for make in (batches, packed_batches):
        tracemalloc.start()
        epoch = make(items, 8, 256, 0, shuffle=True, seed=1, epoch=2)
        held = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        # eager: 20,000 rows x 256 slots x 4 bytes x 3 arrays, 61 MB (twice at its peak)
        assert held < 4 << 20, (make.__name__, held)
        first, last = epoch[0], epoch[-1]
        assert first.tokens.shape == last.labels.shape == (8, 256) and len(epoch) == len(list(epoch))
        assert np.array_equal(epoch[len(epoch) - 1].tokens, last.tokens)
        with pytest.raises(IndexError):
            epoch[len(epoch)]
    order = np.random.default_rng([1, 2]).permutation(len(items))
    b = batches(items, 8, 256, 0, shuffle=True, seed=1, epoch=2)[3]
    for r, k in enumerate(order[24:32]):
        m = len(items[k].tokens) - 1
        assert np.array_equal(b.tokens[r, :m], items[k].tokens[:-1]) and (b.tokens[r, m:] == 0).all()


def test_first_fit_decreasing_matches_the_obvious_version():
    rng = np.random.default_rng(0)
    for _ in range(20):
        sizes = rng.integers(1, 30, size=int(rng.integers(1, 60))).tolist()
        rows = first_fit_decreasing(sizes, 32)
        assert rows == naive_ffd(sizes, 32)
        assert sorted(i for r in rows for i in r) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in r) <= 32 for r in rows)
    assert first_fit_decreasing([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    with pytest.raises(DataError, match="9 slots does not fit rows of 8"):
        first_fit_decreasing([3, 9], 8)


def test_packed_batches_restart_positions_and_keep_labels_per_example():
    rng = np.random.default_rng(1)
    items = make_items(rng, 9, 10)
    bs = packed_batches(items, 2, 16, 0, shuffle=True, seed=3, epoch=0)
    seen = []
    for b in bs:
        for r in range(2):
            seg = b.segments[r]
            for sid in np.unique(seg[seg > 0]):
                at = np.flatnonzero(seg == sid)
                assert np.array_equal(at, np.arange(at[0], at[-1] + 1))   # contiguous
                assert np.array_equal(b.positions[r, at], np.arange(len(at)))
                match = [it for it in items if it.tokens[:-1] == b.tokens[r, at].tolist()]
                it = match[0]
                want = np.where(it.target_mask[1:], it.tokens[1:], -1)
                assert np.array_equal(b.labels[r, at], want)   # never the next example's token
                seen.append(it.line)
            assert np.all(b.labels[r, seg == 0] == -1) and np.all(b.tokens[r, seg == 0] == 0)
    assert sorted(seen) == list(range(1, 10))
    assert sum(b.real_tokens for b in bs) == sum(len(it.tokens) - 1 for it in items)
    assert sum(b.n_targets for b in bs) == sum(sum(it.target_mask[1:]) for it in items)


def test_packing_is_a_function_of_seed_and_epoch():
    items = make_items(np.random.default_rng(2), 40, 20)
    one = packed_batches(items, 3, 32, 0, shuffle=True, seed=5, epoch=1)
    again = packed_batches(items, 3, 32, 0, shuffle=True, seed=5, epoch=1)
    other = packed_batches(items, 3, 32, 0, shuffle=True, seed=5, epoch=2)
    assert all(np.array_equal(a.tokens, b.tokens) and np.array_equal(a.segments, b.segments)
               for a, b in zip(one, again))
    assert not all(np.array_equal(a.tokens, b.tokens) for a, b in zip(one, other))
    # Every epoch has the same number of batches (the loop's epoch arithmetic relies on it).
    n = batches_per_epoch(items, 3, 32, pack=True)
    assert all(len(packed_batches(items, 3, 32, 0, shuffle=True, seed=5, epoch=e)) == n
               for e in range(6))
    eff = packing_efficiency(items, 3, 32)
    assert eff["packed"] > eff["unpacked"] and eff["packed"] <= 1.0


def test_an_example_of_seq_len_plus_one_tokens_fills_a_row_as_unpacked():
    rng = np.random.default_rng(3)
    full = Encoded(rng.integers(3, 50, 17).tolist(), [False] * 4 + [True] * 13, True, 1)
    items = [full] + make_items(rng, 4, 6)
    packed = packed_batches(items, 1, 16, 0, shuffle=False, seed=0, epoch=0)
    alone = batches([full], 1, 16, 0, shuffle=False, seed=0, epoch=0)[0]
    row = [b for b in packed if b.segments[0, 0] == 1 and b.segments[0, -1] == 1]
    assert len(row) == 1 and np.array_equal(row[0].tokens, alone.tokens)
    assert np.array_equal(row[0].labels, alone.labels)
    too_long = Encoded(list(range(3, 21)), [True] * 18, False, 7)
    with pytest.raises(DataError, match="line 7: 18 tokens do not fit seq_len 16"):
        packed_batches([too_long], 1, 16, 0, shuffle=False, seed=0, epoch=0)


# --- the model: packed == unpacked ---------------------------------------------------------------
WRITERS = {"llama": tiny_models.write_tiny_llama, "qwen2": tiny_models.write_tiny_qwen2,
           "qwen3": tiny_models.write_tiny_qwen3, "gemma3": tiny_models.write_tiny_gemma3,
           "llama3": tiny_models.write_tiny_llama3}


@pytest.fixture(scope="module", params=list(WRITERS))
def model(request, tmp_path_factory):
    path = WRITERS[request.param](tmp_path_factory.mktemp("m") / f"{request.param}.gguf")
    return GGUFModel(path)


def _recipe(model, batch, seq, pack, dtype, rng_seed=0):
    """A LoRA recipe on every projection with B != 0, so every adapter has a gradient;
    ``dtype`` f64 re-realizes its graph in the numpy backend's f64 (gradient checks)."""
    r = LoRA(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=2, alpha=4)
    r.realize(model, model.config, RecipeOptions(seq_len=seq, batch=batch, pack=pack, seed=1,
                                                 init_scale=0.1))
    if dtype == "f64":
        r.sess = Session(r.graph, dtype="f64")
        r.sess.realize()
    rng = np.random.default_rng(rng_seed)
    r.load_trainable({n: (v + rng.normal(size=v.shape) * 0.1 if n.endswith("lora_b") else v)
                      for n, v in r.trainable().items()})
    return r


def _loss_and_grads(recipe, b):
    s = recipe.sess
    s.reset()
    recipe.upload(b.tokens, b.positions, b.labels, b.segments)
    s.run("backward")
    grads = {p.name: s.download(g) for p, g in recipe.train.grads.items()}
    return float(s.download(recipe.loss_sum)), grads


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-10), ("f32", 1e-5)])
def test_packed_batch_equals_unpacked_batch_and_each_example_alone(model, dtype, tol):
    rng = np.random.default_rng(4)
    T = 24
    items = make_items(rng, 6, 12, vocab=model.config.n_vocab)
    unpacked = batches(items, len(items), T, 0, shuffle=False, seed=0, epoch=0)[0]
    packed_all = packed_batches(items, 1, T, 0, shuffle=False, seed=0, epoch=0)
    rows = len(packed_all)
    assert rows < len(items)
    packed = packed_batches(items, rows, T, 0, shuffle=False, seed=0, epoch=0)[0]
    ref, ref_grads = _loss_and_grads(_recipe(model, len(items), T, False, dtype), unpacked)
    rp = _recipe(model, rows, T, True, dtype)
    got, got_grads = _loss_and_grads(rp, packed)
    assert abs(got - ref) <= tol * abs(ref)
    for name, g in ref_grads.items():
        assert np.abs(got_grads[name] - g).max() <= tol * np.abs(g).max(), name
    # Each example's loss inside the packed batch is its loss alone in a row of its own.
    alone = _recipe(model, 1, T, False, dtype)
    for k, item in enumerate(items):
        row, at = _where(packed, item)
        labels = np.full_like(packed.labels, -1)
        labels[row, at] = packed.labels[row, at]
        mine, n = rp.evaluate(packed.tokens, packed.positions, labels, packed.segments)
        b = batches([item], 1, T, 0, shuffle=False, seed=0, epoch=0)[0]
        own, n_own = alone.evaluate(b.tokens, b.positions, b.labels)
        assert n == n_own and abs(mine - own) <= tol * abs(own), k


def _where(batch, item):
    """(row, slots) of ``item`` in a packed batch."""
    for r in range(batch.tokens.shape[0]):
        for sid in np.unique(batch.segments[r][batch.segments[r] > 0]):
            at = np.flatnonzero(batch.segments[r] == sid)
            if batch.tokens[r, at].tolist() == item.tokens[:-1]:
                return r, at
    raise AssertionError("example not in the batch")


def test_changing_one_example_leaves_the_others_logits_bit_identical(model):
    rng = np.random.default_rng(5)
    T = 24
    items = make_items(rng, 5, 12, vocab=model.config.n_vocab)
    b = packed_batches(items, 1, T, 0, shuffle=False, seed=0, epoch=0)[0]
    g = Graph()
    net = build_decoder(g, model.config, WeightSource(model), batch=1, seq_len=T,
                        options=BuildOptions(packed=True))
    g.output(net.logits)
    s = Session(g)
    s.realize()

    def logits(tokens):
        s.upload(net.tokens, tokens)
        s.upload(net.positions, b.positions)
        s.upload(net.segments, b.segments)
        s.run("forward")
        return s.download(net.logits)

    before = logits(b.tokens)
    changed = b.tokens.copy()
    first = b.segments[0] == 1
    changed[0, first] = (changed[0, first] + 7) % model.config.n_vocab
    after = logits(changed)
    others = b.segments[0] > 1
    assert others.any() and np.array_equal(before[others], after[others])
    assert not np.array_equal(before[first], after[first])


def test_a_packing_recipe_needs_segment_ids(tiny_llama):
    m = GGUFModel(tiny_llama)
    r = LoRA(rank=2)
    r.realize(m, m.config, RecipeOptions(seq_len=8, batch=1, pack=True))
    z = np.zeros((1, 1, 8), np.int32)
    with pytest.raises(GraphError, match="segment ids are needed exactly when"):
        r.step(z, z, z, np.zeros(7, np.float32), is_first=True)


# --- runs: --pack through the training loop -----------------------------------------------------
def test_packed_run_resumes_exactly_and_logs_packing(tiny_qwen2, tmp_path):
    """6 packed steps (grad_accum 2, validation) straight == 3, Ctrl-C, resume, 3 more;
    events carry the packing efficiency, the arena bytes and real (non-pad) tokens."""
    from test_run import _stop_after, cfg_for, events, write_chat_data
    from toygraph.training.run import run_training
    data = write_chat_data(tmp_path / "chat.jsonl")
    kw = dict(steps=6, save_every=3, grad_accum=2, pack=True, seq_len=96)
    run_training(cfg_for(tiny_qwen2, data, tmp_path / "full", **kw))
    ev = events(tmp_path / "full")
    straight = [e["loss"] for e in ev if e["event"] == "step"]
    start = ev[0]
    assert start["packing"]["pack"] is True and start["arena_bytes"] > 0
    assert start["packing"]["efficiency"] == start["packing"]["packed"] > start["packing"]["unpacked"]
    steps = [e for e in ev if e["event"] == "step"]
    assert all(0 < e["real_tokens"] <= e["tokens"] for e in steps)
    assert any(e["event"] == "eval" for e in ev)
    part = tmp_path / "part"
    _stop_after(cfg_for(tiny_qwen2, data, part, **kw), 3)
    run_training(cfg_for(tiny_qwen2, data, part, resume=str(part / "checkpoints" / "step-000003"),
                         **kw))
    losses = {e["step"]: e["loss"] for e in events(part) if e["event"] == "step"}
    assert [losses[s] for s in range(1, 7)] == straight


@pytest.mark.parametrize("rows", [
    [{"text": f"the cat number {i} sat on the mat" * (1 + i % 3)} for i in range(12)],
    [{"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": f"say {i}"},
                   {"role": "assistant", "content": f"the number is {i}"}]} for i in range(12)],
], ids=["text", "messages"])
def test_packed_runs_of_every_data_format(tiny_llama, tmp_path, rows, capsys):
    import json
    from test_run import cfg_for, events
    from toygraph.training.run import run_training
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = cfg_for(tiny_llama, data, tmp_path / "r", pack=True, seq_len=64, steps=2, quiet=False)
    assert run_training(cfg)["status"] == "completed"
    err = capsys.readouterr().err
    assert "packing efficiency (real tokens / slots):" in err
    ev = events(tmp_path / "r")
    assert [e["event"] for e in ev].count("step") == 2
    # text labels every token, a chat only the assistant's: the CPU fuses the head (which
    # computes on labelled rows only) for the chat, where few slots carry a label
    share, fused = ev[0]["labelled_share"], ev[0]["head_fused"]
    assert (share > 0.4 and not fused) if "text" in rows[0] else (share <= 0.4 and fused)
    assert f"labelled: {share:.1%} of the slots" in err


def test_labelled_share_counts_the_labels_of_an_epochs_batches():
    items = make_items(np.random.default_rng(3), 30, 20)
    for pack in (False, True):
        bs = epoch_batches(items, 3, 32, 0, pack=pack, shuffle=True, seed=1, epoch=0)
        labels = sum(int((b.labels != -1).sum()) for b in bs)
        assert labelled_share(items, 3, 32, pack) == labels / (len(bs) * 3 * 32)


def test_packed_lora_steps_on_the_host_executor_match_numpy(tiny_llama, monkeypatch):
    """Three packed LoRA steps through the CUDA backend run on the host device (segment
    ids uploaded per step, the segmented attention kernels, the fused head): every loss
    within 1e-4 of numpy, and the same losses again."""
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    from toygraph.core.optimizer import hp_row
    model = GGUFModel(tiny_llama)
    items = make_items(np.random.default_rng(6), 12, 30, vocab=model.config.n_vocab)
    bs = packed_batches(items, 2, 40, 0, shuffle=True, seed=1, epoch=0)

    def run(backend):
        r = LoRA(targets=("q", "k", "v", "o"), rank=2, alpha=4)
        r.realize(model, model.config, RecipeOptions(seq_len=40, batch=2, backend=backend,
                                                     pack=True, seed=2, init_scale=0.1))
        return [r.step(b.tokens[None], b.positions[None], b.labels[None], hp_row(i + 1, 1e-2),
                       is_first=i == 0, segments=b.segments[None]) for i, b in enumerate(bs[:3])]
    cpu, gpu = run("cpu"), run("cuda")
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(gpu, cpu)), (gpu, cpu)
    assert run("cuda") == gpu
