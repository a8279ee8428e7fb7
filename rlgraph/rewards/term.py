"""One reward term's scoring rule: call it, and check what it returned.

`run_term(fn, completions, meta)` is one finite float per completion, or a `TermFailure` saying what
the term did instead (raised, returned the wrong shape or type, returned NaN/inf for some rows).
The reward pipeline (`combine.py`) calls it in the controller (`reward_workers: 0`); a reward worker
process (`reward_worker.py`) calls it through `answer_term`, which writes the outcome as the JSON the
worker answers. Both sides apply one rule, so where a term runs never changes what counts as a failure.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from typing import Any


class TermFailure(Exception):
    """What went wrong, the rows it hit, and (for non-finite values) the scores with those rows at 0."""

    def __init__(self, problem: str, rows: list[int], partial: list[float] | None = None, raised: bool = False):
        super().__init__(problem)
        self.problem, self.rows, self.partial, self.raised = problem, rows, partial, raised


def run_term(fn: Callable[..., Any], completions: Sequence[str], meta: dict[str, Any]) -> list[float]:
    """One finite float per completion from `fn`, or a `TermFailure` saying what it did instead."""
    try:
        values = fn(list(completions), **meta)
    except Exception as exc:
        raise TermFailure(f"raised {describe_raised(exc)}", list(range(len(completions))), raised=True) from None
    return _checked(values, len(completions))


def answer_term(fn: Callable[..., Any], completions: Sequence[str], meta: dict[str, Any]) -> dict[str, Any]:
    """`run_term` as the JSON a reward worker answers: {"scores": [...]} or {"problem", "rows", "partial", "raised"}."""
    try:
        return {"scores": run_term(fn, completions, meta)}
    except TermFailure as failure:
        return {"problem": failure.problem, "rows": failure.rows, "partial": failure.partial, "raised": failure.raised}


def _checked(values: Any, n: int) -> list[float]:
    everyone = list(range(n))
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # a tensor or an array
    if not isinstance(values, (list, tuple)):
        raise TermFailure(f"returned {type(values).__name__}, not a list of {n} numbers", everyone)
    if len(values) != n:
        raise TermFailure(f"returned {len(values)} scores for {n} completions", everyone)
    scores = [float(v) if isinstance(v, numbers.Real) else math.nan for v in values]
    bad = [i for i, v in enumerate(scores) if not math.isfinite(v)]
    if bad:
        first = values[bad[0]]
        problem = (f"returned {first} (not finite)" if isinstance(first, numbers.Real)
                   else f"returned {type(first).__name__} {first!r}, not a number")
        raise TermFailure(problem, bad, [0.0 if i in set(bad) else v for i, v in enumerate(scores)])
    return scores


def describe_raised(exc: BaseException) -> str:
    """`ValueError: msg (at file.py:12 in fn)`: the exception and the innermost frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    place = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{place}"
