"""`number_problem` says what a value fails to be; `check_number` raises it at the user's line."""

import math

import pytest

from rlgraph.ir.number_checks import check_number, number_problem
from rlgraph.errors import TraceError


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "1", None, True])
def test_refused_values_say_what_is_needed(value):
    assert number_problem(value, low=0) == "a finite number >= 0"


def test_bounds_and_integers():
    assert number_problem(0, low=0, low_open=True) == "a finite number > 0"
    assert number_problem(1.5, low=0, high=1) == "a finite number >= 0 and <= 1"
    assert number_problem(2.0, low=1, integer=True) == "a whole number >= 1"
    assert number_problem(3, low=1, integer=True) is None and number_problem(1, low=0, high=1) is None


def test_check_number_names_owner_value_line_and_fix():
    with pytest.raises(TraceError) as exc:
        check_number("rg.update", "grad_clip", -1, low=0, low_open=True, optional=True)  # E-here
    text = str(exc.value)
    assert "rg.update: grad_clip=-1 is not valid; it must be a finite number > 0 or None" in text
    assert "test_number_checks.py" in text and "fix: pass grad_clip=" in text
    check_number("rg.update", "grad_clip", None, low=0, optional=True)  # None: off
