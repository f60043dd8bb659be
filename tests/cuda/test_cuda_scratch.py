"""One scratch buffer shared by every node that needs kernel scratch (cuda/devmem.py,
cuda/backend.py): the plan holds the largest need instead of the sum, every such node's
launches get the same address, and no node reads anything in it that its own launches did
not write. That last property is checked by running whole steps on the host device with
the scratch poisoned before every node that uses it: the results must stay bit-identical.
A lowering that keeps something in its scratch for later (here: a cross_entropy that sums
the row losses the previous step left) makes the poisoned run differ, so the check can
fail."""
import dataclasses

import numpy as np
import pytest
from support.tiers import one_by_default

from toygraph import ops
from toygraph.ops.lowering import dispatch
from toygraph.cuda.backend import CudaBackend
from toygraph.ops.lowering.registry import REGISTRY
from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
from toygraph.core.graph import Graph
from toygraph.core.session import Session

#: Two fillings: f32/f64 NaN (propagates through sums) and finite garbage (1.3e7 as f32,
#: which fmaxf and friends do not drop the way they drop a NaN).
POISONS = (0xFF, 0x4B)


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def poison_scratch_before_each_node(monkeypatch, byte: int):
    """Make every CudaBackend launch eagerly and fill the shared scratch with ``byte``
    before each node that has scratch (the host device runs synchronously)."""
    monkeypatch.setenv("TOYGRAPH_CUDA_GRAPHS", "0")
    launch_all = CudaBackend._launch_all

    def poisoned(self, nodes):
        for t in nodes:
            if t.id in self.memory.scratch:
                self.ctx.memset(self.scratch_ptr, byte, self.memory.scratch_bytes)
            launch_all(self, [t])
    monkeypatch.setattr(CudaBackend, "_launch_all", poisoned)


def _trained(name: str):
    losses, recipe, _ = run_experiment(EXPERIMENTS[name], backend="cuda", return_recipe=True)
    params = {t.name: recipe.sess.download(t) for t in recipe.graph.by_role("param")}
    return losses, params, recipe.sess.backend


def test_every_scratch_node_gets_the_one_buffer_of_the_largest_need(monkeypatch):
    """The DPO step on the fused head: the policy and reference forwards and the backward
    of linear_cross_entropy, attention_back per layer and global_norm all use scratch."""
    seen = {}
    lower = dispatch.lower

    def recording(node, ptr, scratch=0, *args):
        seen[node.id] = (node, scratch)
        return lower(node, ptr, scratch, *args)
    monkeypatch.setattr("toygraph.cuda.backend.lower", recording)
    backend = _trained("dpo_qv_tiny_llama")[2]
    needs = {tid: dispatch.scratch_bytes(node) for tid, (node, _) in seen.items()}
    users = {tid for tid, n in needs.items() if n}
    ops_using = sorted(seen[tid][0].op for tid in users)
    assert ops_using.count("linear_cross_entropy") == 2      # policy and reference
    assert {"linear_cross_entropy_back", "attention_back", "global_norm"} <= set(ops_using)
    assert backend.scratch_ptr != 0
    assert {seen[tid][1] for tid in users} == {backend.scratch_ptr}
    assert {seen[tid][1] for tid in set(seen) - users} == {0}   # no scratch declared: null
    mem = backend.memory
    assert mem.scratch == {tid: needs[tid] for tid in users}
    report = backend.memory_report()
    assert report["scratch_bytes"] == max(needs.values()) == mem.scratch_bytes
    assert report["scratch_nodes"] == len(users)
    assert report["scratch_shared_saved_bytes"] == sum(needs.values()) - max(needs.values()) > 0
    assert report["resident_bytes"] == (mem.arena_bytes + report["f32_pinned_bytes"]
                                        + report["block_format_bytes"] + max(needs.values()))


@pytest.mark.parametrize("name", one_by_default(["lora_qv_tiny_llama", "dpo_qv_tiny_llama"]))
def test_poisoning_the_shared_scratch_before_each_node_changes_nothing(name, monkeypatch):
    """DPO (linear_cross_entropy "none" forward x2 and backward) and LoRA SFT (its "mean"
    forward's row losses and backward's weight), attention_back, global_norm."""
    losses, params, _ = _trained(name)
    for byte in POISONS:
        with monkeypatch.context() as m:
            poison_scratch_before_each_node(m, byte)
            got_losses, got_params, backend = _trained(name)
        assert not backend.use_graphs and backend.memory.scratch_bytes > 0
        assert got_losses == losses, byte
        for k, v in params.items():
            np.testing.assert_array_equal(got_params[k], v, err_msg=f"{k} poison {byte:#x}")


def _cross_entropy_twice(rng_seed=3):
    """The loss of one cross_entropy node (which has scratch) run twice on the same
    inputs, the second time after the first left its row losses in the scratch."""
    rng = np.random.default_rng(rng_seed)
    g = Graph()
    logits = g.input("logits", (6, 11))
    labels = g.input("labels", (6,), "i32")
    loss = g.output(ops.cross_entropy(logits, labels, reduction="sum"))
    s = Session(g, backend="cuda")
    s.realize()
    s.reset()
    s.upload(logits, rng.standard_normal((6, 11)).astype(np.float32))
    s.upload(labels, np.array([1, 0, 10, -1, 4, 7], np.int32))
    out = []
    for _ in range(2):
        s.run("forward")
        out.append(float(s.download(loss)))
    return out


REGISTRY_CE = REGISTRY["cross_entropy"]


def _lagged(node, at):
    """A wrong cross_entropy: it sums the row losses first, then writes this run's, so it
    reads what its scratch kept from the run before (scratch that outlives its node)."""
    return list(reversed(REGISTRY_CE.build(node, at)))


def test_the_poison_check_catches_scratch_that_outlives_its_node(monkeypatch):
    right = _cross_entropy_twice()
    with monkeypatch.context() as m:
        poison_scratch_before_each_node(m, POISONS[0])
        assert _cross_entropy_twice() == right   # the real lowering: nothing kept
    monkeypatch.setitem(REGISTRY, "cross_entropy", dataclasses.replace(REGISTRY_CE,
                                                                       build=_lagged))
    lagged = _cross_entropy_twice()
    assert lagged[1] == right[1]   # unpoisoned, the lag hides on the second run ...
    for byte in POISONS:
        with monkeypatch.context() as m:
            poison_scratch_before_each_node(m, byte)
            poisoned = _cross_entropy_twice()
        assert poisoned[1] != right[1], byte   # ... and the poisoned run shows it


def test_smollm2_dpo_step_plans_one_256_mib_scratch(smollm2, monkeypatch):
    """SmolLM2 DPO at 2 pairs x 512 on the fused head (bench/results/
    plan-preference-smollm2-2026-11-23.md): three
    linear_cross_entropy nodes each need a [1344, 49152] f32 logits block (1344 rows of
    LCE_CHUNK_BYTES); sharing holds one of them instead of three."""
    import toygraph.recipes.base as recipe_base
    import toygraph.recipes.dpo as dpo
    from toygraph.cuda.devmem import plan_device_memory
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import RecipeOptions

    class PlanOnly(Session):   # order and plan the graph, hand nothing to a backend
        def __init__(self, graph, backend="cpu", **precision):
            super().__init__(graph, "cpu")
            self.backend.realize = lambda *args: None
    monkeypatch.setattr(recipe_base, "Session", PlanOnly)
    model = GGUFModel(smollm2)
    recipe = dpo.DPO(targets=("q", "v"), rank=8, alpha=16)
    recipe.realize(model, model.config, RecipeOptions(seq_len=512, batch=2, backend="cuda"))
    sess = recipe.sess
    outputs = [t for ts in recipe.graph.outputs.values() for t in ts]
    mem = plan_device_memory(sess.schedules["step"], sess.plan, sess.pinned, outputs)
    heads = [t for t in sess.schedules["step"] if t.op and t.op.startswith("linear_cross")]
    block = 4 * 1344 * 49152
    assert [mem.scratch[t.id] for t in heads] == [block] * 3
    assert mem.scratch_bytes == block
    unshared = mem.resident_bytes - mem.scratch_bytes + sum(mem.scratch.values())
    assert unshared - mem.resident_bytes == sum(mem.scratch.values()) - block > 2 * block
    assert mem.report()["scratch_shared_saved_bytes"] == unshared - mem.resident_bytes
