"""Activation checkpointing (toygraph/core/recompute.py): the same gradients bit for bit, a
smaller arena, each block recomputed just before its own backward, nothing outside a
block recomputed, on every family, LoRA and full fine-tuning, CPU and the CUDA host device.
"""
import numpy as np
import pytest

from toygraph import ops
from toygraph.errors import GraphError
from toygraph.fixtures import tiny_models
from toygraph.models.model import GGUFModel
from toygraph.core.graph import Graph
from toygraph.core.buffer_plan import aligned
from toygraph.core.optimizer import build_training, hp_row
from toygraph.recipes import RECIPES, RecipeOptions

B, T = 2, 16
FAMILIES = {"llama": lambda p: tiny_models.write_tiny_llama(p, n_layer=3),
            "qwen2": tiny_models.write_tiny_qwen2, "qwen3": tiny_models.write_tiny_qwen3,
            "gemma3": tiny_models.write_tiny_gemma3, "llama3": tiny_models.write_tiny_llama3}
ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("recompute")
    paths = {}
    for name, write in FAMILIES.items():
        paths[name] = d / f"{name}.gguf"
        write(paths[name])
    for layers in (2, 6):
        paths[f"llama{layers}"] = d / f"llama{layers}.gguf"
        tiny_models.write_tiny_llama(paths[f"llama{layers}"], n_layer=layers)
    return paths


def _recipe(kind):
    return RECIPES["lora"](targets=ALL_TARGETS) if kind == "lora" else RECIPES[kind]()


def _train_step(path, kind, checkpoint, backend="cpu", batch=B, seq=T, pack=False):
    """One AdamW step on fixed random tokens; (recipe, loss, grads by name). ``pack``: each
    row holds three segments (sample packing), positions restarting in each."""
    model = GGUFModel(path)
    recipe = _recipe(kind)
    recipe.realize(model, model.config, RecipeOptions(seq_len=seq, batch=batch, backend=backend,
                                                      checkpoint_activations=checkpoint,
                                                      pack=pack))
    rng = np.random.default_rng(0)
    vocab = model.config.n_vocab
    tokens = rng.integers(0, vocab, (1, batch, seq)).astype(np.int32)
    labels = rng.integers(-1, vocab, (1, batch, seq)).astype(np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (1, batch, 1))
    segments = None
    if pack:
        segments = np.tile(np.repeat(np.int32([1, 2, 3]), [5, 6, seq - 11]), (1, batch, 1))
        pos = np.tile(np.concatenate([np.arange(5), np.arange(6), np.arange(seq - 11)]),
                      (1, batch, 1)).astype(np.int32)
    loss = recipe.step(tokens, pos, labels, hp_row(1, 1e-3), is_first=True, segments=segments)
    grads = {p.name: recipe.sess.download(acc) for p, acc in recipe.train.grads.items()}
    return recipe, loss, grads


def _assert_same_step(plain, ckpt):
    (r0, loss0, g0), (r1, loss1, g1) = plain, ckpt
    assert loss0 == loss1
    assert g0.keys() == g1.keys()
    for name in g0:
        np.testing.assert_array_equal(g0[name], g1[name], err_msg=name)
    after0, after1 = r0.trainable(), r1.trainable()
    for name in after0:
        np.testing.assert_array_equal(after0[name], after1[name], err_msg=name)


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpointed_gradients_are_bit_identical(model_files, family, kind):
    """The recompute runs the same kernels on the same inputs, and autodiff summed the
    gradients before the rewiring, so f32 gradients (and the updated weights) are
    bit-identical, not just close."""
    path = model_files[family]
    _assert_same_step(_train_step(path, kind, False), _train_step(path, kind, True))


def test_checkpointing_a_packed_step_keeps_its_gradients(model_files):
    """Packed rows' segment ids are an input the recomputed attention reads as the
    original did: the same gradients bit for bit."""
    path = model_files["gemma3"]   # sliding windows and segments together
    _assert_same_step(_train_step(path, "lora", False, pack=True),
                      _train_step(path, "lora", True, pack=True))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_cuda_host_device_checkpointed_gradients_are_bit_identical(model_files, kind, monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    path = model_files["llama"]
    plain = _train_step(path, kind, False, backend="cuda")
    ckpt = _train_step(path, kind, True, backend="cuda")
    _assert_same_step(plain, ckpt)
    assert ckpt[0].sess.plan.arena_bytes < plain[0].sess.plan.arena_bytes


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_arena_grows_by_one_saved_input_per_layer(model_files, kind):
    """Checkpointed, each extra layer adds at most its saved input [B*T, n_embd] to the
    planned arena; without checkpointing it adds all of its activations (several times
    that). Measured between a 2- and a 6-layer model of the same widths."""
    arena = {}
    for layers in (2, 6):
        for ckpt in (False, True):
            recipe = _recipe(kind)
            model = GGUFModel(model_files[f"llama{layers}"])
            recipe.realize(model, model.config, RecipeOptions(seq_len=32, batch=4,
                                                              checkpoint_activations=ckpt))
            arena[layers, ckpt] = recipe.sess.plan.arena_bytes
    saved_input = aligned(4 * 32 * model.config.n_embd * 4)
    per_layer = {c: (arena[6, c] - arena[2, c]) / 4 for c in (False, True)}
    assert per_layer[True] <= saved_input, (per_layer, saved_input)
    assert per_layer[False] > 3 * saved_input, (per_layer, saved_input)
    assert arena[6, True] < arena[6, False] / 2, arena


def test_each_block_is_recomputed_after_the_block_above_is_done(model_files):
    """In the step's schedule, block i's recomputed activations appear only after the last
    backward reader of block i+1's, and after that block's gradient accumulations: their
    lifetimes never overlap, so the arena holds one block's activations at a time."""
    recipe, _, _ = _train_step(model_files["llama"], "lora", True)
    schedule = recipe.sess.schedules["step"]
    where = {t.id: i for i, t in enumerate(schedule)}
    spans = []
    for r in recipe.graph.regions:
        clones = [t for t in schedule if t.name.endswith(".recompute")
                  and r.start <= _original(recipe.graph, t).id < r.end]
        ids = {c.id for c in clones}
        readers = [where[t.id] for t in schedule if any(s.id in ids for s in t.srcs)]
        spans.append((min(where[c.id] for c in clones), max(readers)))
    for upper, lower in zip(spans[1:], spans[:-1]):
        assert upper[1] < lower[0], spans
    accs = {a.id for a in recipe.train.grads.values()}
    for i, (p, acc) in enumerate(recipe.train.grads.items()):
        layer = p.name.split(".")[1]
        if p.name.startswith("blk.") and int(layer) > 0:
            effect = next(t for t in schedule if t.op == "accumulate" and t.srcs[0] is acc)
            below = spans[int(layer) - 1][0]
            assert where[effect.id] < below, (p.name, where[effect.id], below)
    assert accs


def _original(graph, clone):
    return graph.find(clone.name[:-len(".recompute")])


def test_only_block_intermediates_are_recomputed(model_files):
    """Consts, params and inputs are shared, never copied; every clone is of a node built
    inside a block and reads only other clones, leaves, or its block's saved input; the
    forward phase (evaluation) runs no recompute."""
    plain, _, _ = _train_step(model_files["llama"], "lora", False)
    recipe, _, _ = _train_step(model_files["llama"], "lora", True)
    g = recipe.graph
    for role in ("const", "param", "input"):
        assert len(g.by_role(role)) == len(plain.graph.by_role(role))
    clones = [t for t in g.nodes if t.name.endswith(".recompute")]
    assert recipe.train.checkpoint.regions == recipe.model_cfg.n_layer == len(g.regions)
    assert recipe.train.checkpoint.cloned == len(clones) > 0
    assert plain.train.checkpoint is None
    regions = {r.name: r for r in g.regions}
    for c in clones:
        orig = _original(g, c)
        region = next(r for r in regions.values() if r.start <= orig.id < r.end)
        assert orig is not region.output
        for s in c.srcs:
            assert s.role is not None or s is region.input or s.name.endswith(".recompute"), s
    assert not any(t.name.endswith(".recompute") for t in recipe.sess.schedules["forward"])


def test_region_needs_an_output_built_inside_it():
    g = Graph()
    x = g.input("x", (2, 3))
    with pytest.raises(GraphError, match="output must be a node built inside it"):
        with g.region("r", x) as r:
            r.output = x
    assert g.regions == []


def test_a_cycle_in_the_recompute_order_is_refused():
    """When something after a region reads one of its intermediates (not its output), the
    gradient of the output needs the recomputed intermediate, which must come after that
    gradient: the ordering would close a cycle. Refused at build time, never scheduled
    wrongly."""
    g = Graph()
    x = g.input("x", (4, 3))
    w = g.param("w", np.ones((3, 3), np.float32))
    with g.region("r", x) as r:
        inner = ops.silu(x @ w)
        r.output = inner * inner
    loss = g.output((r.output * inner).sum())
    with pytest.raises(GraphError, match="cycle"):
        build_training(loss, [w], checkpoint=True)


def test_cli_flag_gives_the_same_run_in_less_memory(capsys, tiny_llama, tmp_path):
    """``finetune --checkpoint-activations``: the same step losses bit for bit, a smaller
    planned arena, and events.jsonl saying checkpointing was on."""
    import json

    from toygraph.cli import main
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))
    runs = {}
    for flag in ([], ["--checkpoint-activations"]):
        out = tmp_path / ("ckpt" if flag else "plain")
        code = main(["finetune", "--model", str(tiny_llama), "--data", str(data), "--out",
                     str(out), "--steps", "3", "--batch", "2", "--seq-len", "32", "--val-split",
                     "0", "--targets", "q,v,down", "--quiet", *flag])
        assert code == 0, capsys.readouterr().err
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        runs[bool(flag)] = (events[0], [e["loss"] for e in events if e["event"] == "step"])
    (start0, losses0), (start1, losses1) = runs[False], runs[True]
    assert start0["checkpoint_activations"] is False and start1["checkpoint_activations"] is True
    assert start1["config"]["checkpoint_activations"] is True
    assert start1["planned_bytes"] < start0["planned_bytes"]
    assert len(losses1) == 3 and losses1 == losses0


def test_checkpointed_golden_experiment_matches_its_plain_twin():
    """The golden experiment lora_all_tiny_qwen2_ckpt is lora_all_tiny_qwen2 (LoRA on every
    projection, 2 micro-batches per step) with checkpointing on: fresh runs of the two give
    the same losses bit for bit."""
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    ckpt = EXPERIMENTS["lora_all_tiny_qwen2_ckpt"]
    plain = EXPERIMENTS["lora_all_tiny_qwen2"]
    assert {**ckpt.options, "checkpoint_activations": False} == {**plain.options,
                                                                 "checkpoint_activations": False}
    assert run_experiment(ckpt) == run_experiment(plain)


def test_regions_do_not_nest():
    g = Graph()
    x = g.input("x", (2, 3))
    with pytest.raises(GraphError, match="do not nest"):
        with g.region("outer", x) as outer:
            with g.region("inner", x):
                pass
            outer.output = ops.silu(x)
    with g.region("after", x) as r:  # a failed region leaves the graph usable
        r.output = ops.silu(x)
    assert [r.name for r in g.regions] == ["after"]


def test_effects_that_read_state_keep_their_place():
    """Only gradient accumulations are moved earlier. An effect reading a state buffer that
    another effect writes (here: a copy of a gradient accumulator, as a gradient all-reduce
    would be) has no edge to that writer, so it keeps its place after them."""
    from toygraph.core.autodiff import accumulate_grads, gradient_map
    from toygraph.core.recompute import checkpoint_regions
    from toygraph.core.session import Session
    rng = np.random.default_rng(0)
    g = Graph()
    h = g.input("x", (4, 3))
    ws = []
    for i in range(2):
        w = g.param(f"w{i}", rng.normal(size=(3, 3)).astype(np.float32))
        with g.region(f"r{i}", h) as r:
            h = r.output = ops.silu(h @ w) * h
        ws.append(w)
    loss = g.output(h.sum())
    first = len(g.nodes)
    grads = gradient_map(loss, ws)
    accs = accumulate_grads({w: grads[w.id] for w in ws})
    copy = g.state("copy", (3, 3), kind="grad")
    reader = g.effect(ops.accumulate(copy, accs[ws[0]]), "backward")
    checkpoint_regions(g, first, grads)
    sess = Session(g)
    sess.realize()
    order = [t.id for t in sess.schedules["backward"]]
    writers = [t.id for t in sess.schedules["backward"] if t.op == "accumulate" and t is not reader]
    assert all(order.index(reader.id) > order.index(w) for w in writers)
    assert any(t.name.endswith(".recompute") for t in sess.schedules["backward"])


def test_resume_may_switch_checkpointing_on(tiny_llama, tmp_path):
    """4 steps straight == 2 steps, then resumed with --checkpoint-activations for 2 more:
    checkpointing changes no number, so resume accepts it without --allow-change."""
    import json

    from toygraph.training import RunConfig, run_training
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))

    def cfg(out, **kw):
        return RunConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / out),
                           batch=2, seq_len=32, val_split=0.0, schedule="constant", quiet=True,
                           **kw)

    def losses(out):
        lines = (tmp_path / out / "events.jsonl").read_text().splitlines()
        return {e["step"]: e["loss"] for e in map(json.loads, lines) if e["event"] == "step"}

    run_training(cfg("straight", steps=4))
    run_training(cfg("part", steps=2))
    run_training(cfg("part", steps=4, resume=str(tmp_path / "part"), allow_change=("steps",),
                     checkpoint_activations=True))
    assert losses("part") == losses("straight") and len(losses("straight")) == 4
    starts = [e for e in map(json.loads, (tmp_path / "part" / "events.jsonl").read_text()
                             .splitlines()) if e["event"] == "run_start"]
    assert [s["checkpoint_activations"] for s in starts] == [False, True]
