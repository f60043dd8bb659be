"""The shape ops (ops/shape/: reshape, permute, contiguous, expand, sum_to, sum, unpack):
f64 finite-difference gradients, unpack's values and errors, and their CUDA launches
(Strided walks, copies, reductions) replayed in numpy against the numpy kernels."""
import numpy as np
import pytest

from support.cudaemu import check_lowering, const_node
from support.gradcheck import TOL, gradcheck_unary
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.ops.lowering import dispatch
from support.kernelsrc import OP_KERNELS
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.session import Session


@pytest.mark.parametrize("name,build,shape", [
    ("reshape", lambda x: x.reshape(6, 4), (2, 3, 4)),
    ("permute", lambda x: x.permute(2, 0, 1), (2, 3, 4)),
    ("transpose", lambda x: x.T, (3, 5)),
    ("contiguous", ops.contiguous, (3, 4)),
    ("sum_all", lambda x: ops.sum(x), (3, 4)),
    ("sum_axis", lambda x: ops.sum(x, 1), (3, 4, 2)),
    ("sum_to", lambda x: ops.sum_to(x, (1, 4)), (3, 4)),
    ("sum_to_groups", lambda x: ops.sum_to(x, (2, 2, 3)), (2, 6, 3)),
    ("expand", lambda x: ops.expand(x, (3, 2, 4)), (2, 1)),
    ("expand_groups", lambda x: ops.expand(x, (2, 6, 3)), (2, 2, 3)),
])
def test_unary_gradients(name, build, shape):
    assert gradcheck_unary(build, shape) <= TOL


def test_unpack_values_and_errors():
    g = Graph()
    x = g.const("x", np.arange(10.0))
    y = g.output(ops.unpack(x, 3, (2, 3)))
    s = Session(g, dtype="f64"); s.realize(); s.run("forward")
    np.testing.assert_array_equal(s.download(y), np.arange(3.0, 9.0).reshape(2, 3))
    with pytest.raises(GraphError, match="unpack.*outside"):
        ops.unpack(x, 5, (2, 3))


@pytest.mark.parametrize("build,shapes", [
    (lambda x: x.permute(2, 0, 1), [(2, 3, 4)]), (lambda x: x.permute(0, 2, 1, 3), [(2, 3, 4, 5)]),
    (lambda x: x.T, [(3, 5)]), (lambda x: x.reshape(4, 6), [(2, 3, 4)]),
    (lambda x: ops.expand(x, (3, 2, 4)), [(2, 1)]), (lambda x: ops.expand(x, (2, 6, 3)), [(2, 2, 3)]),
    (lambda x: ops.expand(x, (2, 3, 4)), [(1, 1, 4)]),
    (lambda x: ops.sum_to(x, (1, 4)), [(3, 4)]), (lambda x: ops.sum_to(x, (2, 2, 3)), [(2, 6, 3)]),
    (lambda x: ops.sum_to(x, (4,)), [(2, 3, 4)]), (lambda x: ops.sum_to(x, (3, 1)), [(2, 3, 200)]),
    (lambda x: ops.sum(x), [(3, 4)]), (lambda x: ops.sum(x, 1), [(3, 4, 2)]),
    (lambda x: ops.sum(x, 0), [(300, 2)]),
])
def test_lowering_walks_match_numpy(build, shapes):
    node, vals = const_node(build, *shapes)
    check_lowering(node, vals)


def test_unpack_lowers_to_a_copy_from_the_offset():
    g = Graph()
    x = g.const("x", np.arange(20.0))
    node = ops.unpack(x, 7, (3, 4))
    (launch,) = dispatch.lower(node, lambda t: (t.id + 1) << 20)
    assert launch.kernel == "tg_copy" and launch.kernel in OP_KERNELS["unpack"]
    assert int(launch.args[1][0]) == ((x.id + 1) << 20) + 4 * 7 and int(launch.args[2][0]) == 12
