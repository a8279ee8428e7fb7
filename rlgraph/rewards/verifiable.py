"""Verifiable rewards: pure functions `fn(completions, **meta) -> list[float]`, one score per row.

`meta` holds the per-row fields of the rollouts (such as `answer`); a reward takes the fields it
needs by name and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

RewardFn = Callable[..., list[float]]


def exact_match(completions: Sequence[str], answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 where the completion equals the reference answer (both stripped of whitespace), else 0.0.

    >>> exact_match([" 12", "13"], answer=["12", "12"])
    [1.0, 0.0]
    """
    if len(completions) != len(answer):
        raise ValueError(f"exact_match: {len(completions)} completions but {len(answer)} answers; "
                         "pass one answer per row")
    return [float(str(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]
