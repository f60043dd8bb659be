"""The op groups (ops/groups.py): who is in each, that membership is declared where the
op is defined and nowhere else, and that the code reading a group picks a new member up
without being edited."""
import re
from pathlib import Path

import numpy as np
import pytest

from toygraph import ops
from toygraph.core.graph import Graph
from toygraph.ops import groups
from toygraph.ops.table import in_place
from toygraph.core.session import Session
from toygraph.errors import GraphError

ROOT = Path(__file__).resolve().parents[2]


def test_the_groups_hold_the_ops_their_definitions_declare():
    assert groups.MEMBERS == {
        groups.VIEW: {"reshape", "contiguous", "unpack"},
        groups.PASS_THROUGH: {"reshape", "permute", "contiguous"},
        groups.IN_PLACE: {"accumulate", "adamw"},
        groups.PACKED: {"attention"}}
    for op, spec in ops.OPS.items():
        assert spec.groups == {g for g, members in groups.MEMBERS.items() if op in members}
    assert in_place("adamw") and not in_place("matmul") and not in_place(None)


def test_an_unknown_group_is_refused_naming_it():
    with pytest.raises(GraphError, match="op 'frob': no op group 'views'"):
        groups.join("frob", {"views"})


def test_no_production_module_keeps_its_own_list_of_a_groups_ops():
    """A tuple or set of two or more of a group's op names written out anywhere but the
    definitions is a second list that goes stale: the group is asked instead."""
    names = "|".join(sorted({op for m in groups.MEMBERS.values() for op in m}))
    literal = re.compile(rf'[({{]\s*"({names})"\s*,\s*"({names})"')
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("toygraph", "recipes")
             for p in (ROOT / folder).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if literal.search(line) and "@lowers(" not in line]   # one lowering, two ops
    assert not found, found


@pytest.fixture
def tables(monkeypatch):
    """The op table, numpy kernels and groups as they are, restored after the test."""
    saved = dict(ops.OPS), dict(ops.KERNELS)
    monkeypatch.setattr(groups, "MEMBERS", dict(groups.MEMBERS))
    yield
    for table, before in zip((ops.OPS, ops.KERNELS), saved):
        table.clear()
        table.update(before)


def test_a_new_pass_through_op_is_looked_through_by_the_upload_range_check(tables):
    """An op that declares the pass-through group at its definition is enough: the session's
    id range check applies the table's row count to the ids before it."""
    def upload_error(name, op_groups):
        """What uploading id 5 (one past the table) between ``name`` and get_rows says."""
        ops.define_op(name, lambda s, d, a: (s[0], d[0]), groups=op_groups)
        ops.kernel(name)(lambda out, srcs, attrs: np.copyto(out, srcs[0]))
        g = Graph()
        ids = g.input("ids", (2, 3), "i32")
        g.output(ops.get_rows(g.const("table", np.ones((5, 4))), ops.make_node(name, [ids])))
        s = Session(g)
        s.realize()
        s.upload(ids, np.full((2, 3), 4, np.int32))
        try:
            s.upload(ids, np.full((2, 3), 5, np.int32))
        except GraphError as e:
            return str(e)
        return None
    assert "value 5 outside [0, 5) (rows of table)" in upload_error("twin", {groups.PASS_THROUGH})
    assert upload_error("other_twin", ()) is None     # not looked through: any int32 passes
