"""Reward terms in supervised worker processes, so that nothing a reward does reaches the controller.

    pool = RewardPool(recipe, workers=2, memory_mb=4096)   # recipe: picklable, () -> [term functions]
    answers = pool.run([(term, completions, meta), ...], timeout_s=600)
    pool.close()                                            # every worker and its descendants killed

A `SupervisedPool` (`rlgraph.supervised`: the processes, their limits, isolation, timeouts and
replacement) whose workers build the terms from the recipe once (`reward_worker.ScoreTerms`) and
score one call at a time. A call that times out, or whose worker dies, is a failure the pipeline
scores by its `on_error` policy ("timed out after 600 s (reward_timeout_s) (its reward worker was
killed and replaced)", "killed by signal 9 in its reward worker"). docs/security.md says what the
isolation holds against.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from rlgraph.errors import ConfigError, RewardError
from rlgraph.rewards.reward_worker import ScoreTerms
from rlgraph.supervised.pool import BuildError, PoolNames, SupervisedPool, check_settings

WORKERS_ENV = "RLGRAPH_REWARD_WORKERS"
NAMES = PoolNames("reward_", "reward", "reward_timeout_s", "scores")


def default_workers() -> int:
    """min(4, the CPUs this process may use): rewards are short; more processes cost memory, not speed.
    RLGRAPH_REWARD_WORKERS overrides it (the test suite sets 0: each run's pool costs ~1 s to start)."""
    value = os.environ.get(WORKERS_ENV)
    if value is None:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    if not value.strip().isdigit():
        raise ConfigError(f"the environment variable {WORKERS_ENV}={value!r} is not a whole number >= 0",
                          fix=f"unset it (default: min(4, CPUs)), or set e.g. {WORKERS_ENV}=2 (0: in the controller)")
    return int(value)


class RewardPool(SupervisedPool):
    """A small pool of supervised reward worker processes, started on first use."""

    def __init__(self, recipe: Callable[[], Sequence[Callable[..., Any]]], workers: int, *, memory_mb: int = 4096,
                 max_processes: int = 512, isolation: str = "auto", answer_bytes: int = 64 << 20,
                 start_timeout_s: float = 120.0):
        check_settings(NAMES, workers, memory_mb, max_processes, "1 or more (0 scores in the controller, for debugging)")
        try:
            recipe_bytes = pickle.dumps(recipe)
        except Exception as exc:  # a lambda or closure: the worker could not rebuild it
            raise ConfigError(f"the reward terms cannot be sent to reward worker processes: {type(exc).__name__}: {exc}",
                              fix="define each reward function at module level (importable by its module path), "
                                  "or score in the controller process with reward_workers: 0") from None
        super().__init__(functools.partial(ScoreTerms, recipe_bytes), workers, names=NAMES, memory_mb=memory_mb,
                         max_processes=max_processes, isolation=isolation, answer_bytes=answer_bytes,
                         start_timeout_s=start_timeout_s)

    def run(self, calls: Sequence[tuple[int, list[str], dict[str, Any]]], timeout_s: float | None  # type: ignore[override]
            ) -> list[dict[str, Any]]:
        """Each call's answer: {"scores": [...]} or a failure {"problem", "rows", "partial", "raised"}."""
        payloads = [pickle.dumps(("score", term, list(completions), dict(meta))) for term, completions, meta in calls]
        sizes = [len(completions) for _, completions, _ in calls]
        try:
            answers = super().run(payloads, timeout_s, valid=lambda answer, call: _answer(answer, sizes[call]))
        except BuildError as error:
            raise RewardError(f"a reward worker could not build the reward terms: {error}\n  fix: the reward "
                              "functions must import in a fresh process (module-level functions, their modules on "
                              "sys.path); check reward_memory_mb, or set reward_workers: 0 to score in the controller"
                              ) from None
        return [{"problem": answer["failed"], "rows": list(range(size)), "partial": None, "raised": False}
                if "failed" in answer else _finite(answer) for answer, size in zip(answers, sizes)]


def _finite(answer: dict[str, Any]) -> dict[str, Any]:
    """A worker's scores checked where they enter the controller: JSON carries NaN and Infinity, and a
    worker is not trusted to have run `term.run_term`'s checks; a non-finite score is the failure of its rows."""
    scores = answer.get("scores", answer.get("partial"))
    bad = [row for row, value in enumerate(scores or ()) if not math.isfinite(value)]
    if not bad:
        return answer
    zeroed = [0.0 if row in set(bad) else value for row, value in enumerate(scores)]
    if "scores" in answer:
        return {"problem": f"its reward worker answered {scores[bad[0]]} (not finite)", "rows": bad,
                "partial": zeroed, "raised": False}
    return {**answer, "rows": sorted(set(answer["rows"]) | set(bad)), "partial": zeroed}


def _answer(answer: Any, rows: int) -> bool:
    """A worker's JSON answer to a scoring call: scores or a failure (else the channel is not ours)."""
    return isinstance(answer, dict) and (_scores(answer.get("scores"), rows) or _failure(answer, rows))


def _scores(values: Any, rows: int) -> bool:
    return isinstance(values, list) and len(values) == rows and all(type(value) is float for value in values)


def _failure(answer: dict[str, Any], rows: int) -> bool:
    """A failure as `term.answer_term` writes it: a problem, the rows it hit (some of `rows`), maybe partial scores."""
    hit = answer.get("rows")
    return (isinstance(answer.get("problem"), str) and isinstance(answer.get("raised"), bool)
            and isinstance(hit, list) and all(type(row) is int and 0 <= row < rows for row in hit)
            and (answer.get("partial") is None or _scores(answer.get("partial"), rows)))
