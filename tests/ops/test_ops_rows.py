"""get_rows (ops/rows/): the f64 finite-difference gradient with repeated ids. Its CUDA
launches (dense and block-format tables) are replayed in test_ops_gemm.py's block-format
test and run on the host device in test_cuda_host.py."""
import numpy as np

from support.gradcheck import TOL, check_gradients, rnd, weighted_sum
from toygraph import ops
from toygraph.core.graph import Graph


def test_get_rows_gradient_with_repeats():
    rng = np.random.default_rng(6)
    g = Graph()
    table = g.param("table", rnd(rng, 7, 3))
    ids = g.input("ids", (2, 4), "i32")
    y = ops.get_rows(table, ids)
    idv = np.array([[0, 3, 3, 6], [1, 0, 3, 2]], np.int32)
    assert check_gradients(g, weighted_sum(y, rng), [table], {ids: idv}) <= TOL
