"""Named groups of ops: the one place the code that treats a kind of op alike asks which
ops are of that kind, instead of keeping its own list of op names.

An op joins a group where it is defined, ``define_op(name, ..., groups={VIEW})`` in its
family module, so a new op of a kind needs no edit here or in the code reading the group.

>>> from toygraph.ops.groups import VIEW, member
>>> member("reshape", VIEW)
True
"""
from __future__ import annotations

from toygraph.errors import GraphError

#: The result is its source's bytes from an element offset on (``view_offset``), so the
#: buffer plan may make it a view of them: no buffer, no copy (core/buffer_plan.py), and a
#: bf16 buffer passes through it as it is (cuda/bf16_storage.py).
VIEW = "view"
#: Integer values flow through it unchanged, so the id range an upload is checked against
#: is the one its readers beyond it ask for (core/session.py).
PASS_THROUGH = "pass_through"
#: Writes into its first operand(s) instead of producing a value (the gradient
#: accumulation, the optimizer update): a side effect, with no buffer of its own and never
#: dropped as dead.
IN_PLACE = "in_place"
#: Its one flat result packs several, read through ``unpack`` views (attention: o, then the
#: row log-sum-exp its backward reads): autodiff hands its backward rule {view offset:
#: gradient} instead of one gradient of the packed tensor (core/autodiff.py).
PACKED = "packed"

#: group -> the ops in it, filled by define_op.
MEMBERS: dict[str, frozenset[str]] = {g: frozenset() for g in (VIEW, PASS_THROUGH, IN_PLACE,
                                                                PACKED)}


def join(op: str, groups) -> None:
    """Enter ``op`` in each of ``groups`` (define_op's ``groups=``)."""
    unknown = sorted(set(groups) - set(MEMBERS))
    if unknown:
        raise GraphError(f"op {op!r}: no op group {unknown[0]!r} (groups: {sorted(MEMBERS)})")
    for g in groups:
        MEMBERS[g] = MEMBERS[g] | {op}


def member(op: str | None, group: str) -> bool:
    """Whether ``op`` (None: a leaf tensor, in no group) is in ``group``."""
    return op in MEMBERS[group]

