"""What a reward worker process does (`rlgraph.supervised.process` runs it): score batches.

`ScoreTerms(recipe)` is built once in the worker from the pickled recipe (a picklable callable
returning the term functions); each request ("score", term, completions, meta) is answered with
`term.answer_term`'s JSON: {"scores": [...]} or a failure {"problem", "rows", "partial", "raised"}.
"""

from __future__ import annotations

import pickle
from typing import Any

from rlgraph.rewards.term import answer_term


class ScoreTerms:
    """The reward terms of one worker; `__call__` answers one scoring request."""

    def __init__(self, recipe: bytes):
        self.functions = list(pickle.loads(recipe)())

    def __call__(self, request: tuple) -> dict[str, Any]:
        _, term, completions, meta = request
        return answer_term(self.functions[term], completions, meta)
