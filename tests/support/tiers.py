"""Which cases of a parametrized table run in the default tier.

A kernel-mutation test builds the whole host executor once per mutation (seconds each).
One mutation per table shows in every run that the parity check catches a broken index;
the rest run in the slow tier (`-m slow`), where a change to that kernel should be
checked before it lands.
"""
import pytest


def one_by_default(cases, default=None):
    """``cases`` (a dict's keys or a list) as pytest params, all but one marked slow.

    ``default`` names the case kept in the default tier; without it the first in sorted
    order (dict keys) or in the given order (lists of tuples) stays."""
    if isinstance(cases, dict):
        cases = sorted(cases)
    cases = list(cases)
    keep = cases[0] if default is None else default
    if keep not in cases:
        raise ValueError(f"default case {keep!r} is not one of the cases")
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)),
                         marks=() if c == keep else pytest.mark.slow)
            for c in cases]
