"""The runtime's error types: what reaches the controller when a plan cannot run or a worker fails.

Each names where it happened (the rank; the plan step, its stage and role once the runner adds
them), so a failure far from the controller still reads as one message about the user's run.
"""

from __future__ import annotations

from rlgraph.errors import RankFailure
from rlgraph.errors import RLGraphError


class WorkerFailure(RankFailure):
    """A worker raised, died or did not answer in time; `rank` says which (None: several)."""


class PlanInputError(RLGraphError):
    """A batch the plan cannot run (it cannot be split as the plan's layouts say)."""


class PlanStepError(RLGraphError):
    """A plan step failed on a worker: the message names the step, its stage, its role and the rank."""


class RankMetricWarning(UserWarning):
    """A metric a rank sent the controller is not finite; the message names the metric, the role and the rank."""
