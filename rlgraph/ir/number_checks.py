"""Range checks for user-given numbers: hyper-parameters, primitive arguments, sizes.

One helper so every algorithm and primitive refuses a bad number the same way, at the user's line:

    check_number("grpo", "clip", clip, low=0, low_open=True)   # clip=-1 -> TraceError "grpo: clip=-1 ..."
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

from rlgraph.errors import SourceLocation, TraceError, user_location


def number_problem(value: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                   integer: bool = False) -> str | None:
    """What `value` fails to be (e.g. "a number > 0"), or None when it is fine.

    bool is refused: `True` is an int to Python but never a meant count or coefficient.
    """
    kind = "a whole number" if integer else "a finite number"
    need = kind + (f" {'>' if low_open else '>='} {low:g}" if low is not None else "") + \
        (f" and <= {high:g}" if high is not None else "")
    wanted = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, wanted) or not math.isfinite(value):
        return need
    if low is not None and (value < low or (low_open and value == low)):
        return need
    if high is not None and value > high:
        return need
    return None


def check_number(owner: str, name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, integer: bool = False, optional: bool = False, why: str = "",
                 where: SourceLocation | None = None) -> None:
    """Raise a TraceError at `where` (default: the caller's user line) when `owner`'s `name`=`value` is out of range.

    `optional`: None is accepted (the option is off). `why` says what the bound protects against.
    """
    if optional and value is None:
        return
    need = number_problem(value, low=low, high=high, low_open=low_open, integer=integer)
    if need is None:
        return
    off = " or None" if optional else ""
    error = TraceError(f"{owner}: {name}={value!r} is not valid; it must be {need}{off}" + (f" ({why})" if why else ""),
                       where or user_location(sys._getframe(1)), fix=f"pass {name}= {need}{off}")
    error.hparam = name  # the CLI and `rlgraph train` name the flag or config line that set it
    raise error


def _about(hparam: str, error: TraceError) -> TraceError:
    error.hparam = hparam
    return error


def check_group_size(owner: str, n: Any, estimator: str = "a group estimator", where: SourceLocation | None = None) -> None:
    """Group baselines compare a sample with the others of its prompt: n=1 leaves no others."""
    where = where or user_location(sys._getframe(1))
    check_number(owner, "n", n, low=1, integer=True, where=where)
    if n < 2:
        raise _about("n", TraceError(
            f"{owner}: n={n} samples per prompt, but {estimator} compares each sample with the other samples of its "
            "prompt; with n=1 every advantage is 0 (or undefined) and nothing is learnt", where, fix="pass n >= 2, e.g. n=4"))
