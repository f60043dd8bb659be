"""The optimizer ops' multi-tensor form (ops/update/, update.cu): one adamw node updates
every param exactly as one node per param did (numpy, and the CUDA kernels on the host
executor), CUDA runs it and the gradient norm in ceil(params / LIST_TENSORS) launches over a
table of tensors passed by value, at ragged sizes, with per-tensor learning-rate scales and
clipping; a deliberately broken index of the table lookup fails the check."""
import numpy as np
import pytest

from support.hostparity import break_kernel, rel_err
from support.tiers import one_by_default
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.core.optimizer import hp_row
from toygraph.core.session import Session
from toygraph.ops.lowering.constants import LIST_TENSORS, THREADS
from toygraph.errors import GraphError

#: Sizes around a block's THREADS elements and a few large ones; 70 > LIST_TENSORS tensors.
SIZES = [1, 5, THREADS - 1, THREADS, THREADS + 1, 3 * THREADS + 7, 4000] * 10


def _graph(sizes, grouped: bool, max_norm=0.5, seed=0):
    """Params of ``sizes`` with fixed gradients: one adamw node for all (``grouped``) or
    one per param. Returns (graph, params, moments, norm)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    params = [g.param(f"w{i}", rng.normal(size=n).astype(np.float32)) for i, n in enumerate(sizes)]
    grads = [g.const(f"g{i}", rng.normal(size=n).astype(np.float32)) for i, n in enumerate(sizes)]
    ms = [g.state(f"m{i}", (n,), kind="moment") for i, n in enumerate(sizes)]
    vs = [g.state(f"v{i}", (n,), kind="moment") for i, n in enumerate(sizes)]
    hp, div = g.input("hp", (9,)), g.const("div", np.float32(3.0))
    norm = g.output(ops.global_norm(grads, div), "step")
    scales = [1.0 + (i % 3) for i in range(len(sizes))]        # LoRA+-like per-tensor rates
    groups = [list(range(len(sizes)))] if grouped else [[i] for i in range(len(sizes))]
    for idx in groups:
        g.effect(ops.adamw([params[i] for i in idx], [grads[i] for i in idx],
                           [ms[i] for i in idx], [vs[i] for i in idx], hp, norm, div,
                           max_norm=max_norm, lr_scales=[scales[i] for i in idx]), "step")
    return g, params, ms + vs, norm


def _steps(backend, sizes, grouped, steps=2, **kw):
    g, params, moments, norm = _graph(sizes, grouped, **kw)
    s = Session(g, backend=backend)
    s.realize()
    s.reset()
    for t in range(1, steps + 1):
        s.upload("hp", hp_row(t, lr=1e-2, weight_decay=0.1))
        s.run("step")
    return [s.download(x) for x in [norm, *params, *moments]], s


@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


def test_numpy_one_node_is_bit_identical_to_one_node_per_param():
    for a, b in zip(_steps("cpu", SIZES[:9], True)[0], _steps("cpu", SIZES[:9], False)[0]):
        assert np.array_equal(a, b)


def test_cuda_lists_are_bit_identical_to_one_tensor_launches(host_device):
    """Every param in one node (two launches of up to LIST_TENSORS) against one node per
    param (a one-tensor table each): the table's block mapping changes no bit."""
    grouped, s = _steps("cuda", SIZES, True)
    single, _ = _steps("cuda", SIZES, False)
    for a, b in zip(grouped, single):
        assert np.array_equal(a, b)
    kernels = [item[0] for items in s.backend._launches.values() for item in items]
    n_lists = -(-len(SIZES) // LIST_TENSORS)
    assert len(kernels) == 2 * n_lists + 1   # adamw lists, sumsq lists, the norm's sum


def test_cuda_matches_numpy(host_device):
    got, _ = _steps("cuda", SIZES, True)
    want, _ = _steps("cpu", SIZES, True)
    assert rel_err(got[0], want[0]) <= 1e-6          # the norm: f64 sums either way
    for a, b in zip(got[1:], want[1:]):
        assert rel_err(a, b) <= 1e-5


def test_mismatched_lists_are_refused():
    g = Graph()
    w = g.param("w", np.ones(3, np.float32))
    hp, z = g.input("hp", (9,)), g.scalar(1.0)
    with pytest.raises(GraphError, match="one grad, m and v per param"):
        ops.adamw([w], [w, w], [w], [w], hp, z, z, max_norm=0.0)
    with pytest.raises(GraphError, match="one lr scale per param"):
        ops.adamw([w], [w], [w], [w], hp, z, z, max_norm=0.0, lr_scales=[1.0, 2.0])


#: One index of update.cu's table lookup changed as a careless edit would.
MUTATIONS = {
    "a tensor's first block goes to the tensor before": (
        "if (l.block_start[mid] <= (int)blockIdx.x) lo = mid;",
        "if (l.block_start[mid] < (int)blockIdx.x) lo = mid;"),
    "each block takes its next block's share": (
        "block = (int)blockIdx.x - l.block_start[lo];",
        "block = (int)blockIdx.x - l.block_start[lo] + 1;"),
}


@pytest.mark.parametrize("mutation", one_by_default(MUTATIONS))
def test_a_broken_index_fails_the_parity_check(mutation, host_device, monkeypatch):
    want, _ = _steps("cpu", SIZES[:14], True, steps=1)
    break_kernel(monkeypatch, *MUTATIONS[mutation])
    got, _ = _steps("cuda", SIZES[:14], True, steps=1)
    errors = [rel_err(a, b) for a, b in zip(got, want)]
    assert not all(e <= 1e-5 for e in errors), errors
