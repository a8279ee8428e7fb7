"""The one rule for which collective moves a value between two layouts (the compiler's and the runtime's)."""

import pytest

from rlgraph.plan.layouts import CONTROLLER, collective_kind
from rlgraph.runtime import collectives

GROUP = ((0, 1), 2)


@pytest.mark.parametrize("src, dst, per_row, kind", [
    ((CONTROLLER,), GROUP, True, "scatter"),                # rows are cut, one shard per data-parallel rank
    ((CONTROLLER,), ((0, 1), 1), False, "broadcast"),       # a scalar is replicated
    (GROUP, (CONTROLLER,), True, "gather"),
    (GROUP, ((0, 1), 1), True, "all_to_all"),               # the same ranks, another split
    (GROUP, ((2, 3), 2), True, "send_recv"),                # other ranks
])
def test_each_pair_of_layouts_has_one_collective(src, dst, per_row, kind):
    assert collective_kind(src, dst, per_row) == kind


def test_the_runtimes_reference_collectives_check_moves_against_the_same_rule():
    assert collectives.expected_kind is collective_kind and collectives.CONTROLLER == CONTROLLER
